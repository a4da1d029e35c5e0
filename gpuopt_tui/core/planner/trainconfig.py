"""A training YAML config as the planner reads and writes it: roles (batch size, accumulation, model, LoRA, ...)
found at the keys of the framework layout detected (`layouts`), in the file of a composed config whose value
wins, each with the file and line it was read from."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.planner import layouts, yamledit
from gpuopt_tui.core.planner.compose import Composition, Source, compose
from gpuopt_tui.core.planner.train_setup import PRECISIONS, TRAINABLE, out_of_range

ROLES = (
    "model",
    "batch_size",
    "accumulate",
    "seq_len",
    "precision",
    "trainable",
    "lora_rank",
    "lora_targets",
    "gradient_checkpointing",
    "devices",
    "zero_stage",
    "n_positives",
    "n_negatives",
)
_REFERENCE = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")


def parse_keys(items: Sequence[str]) -> dict[str, str]:
    """`role=dotted.key` items (from --key or a profile) as a mapping; UserError for unknown roles."""
    out = {}
    for item in items:
        role, sep, key = item.partition("=")
        role, key = role.strip(), key.strip()
        if not sep or not key:
            raise UserError(f'key "{item}": expected role=dotted.key, e.g. batch_size=data.train.bs')
        if role not in ROLES:
            raise UserError(f'key "{item}": unknown role "{role}" (roles: {", ".join(ROLES)})')
        out[role] = key
    return out


@dataclass(frozen=True)
class Setting:
    role: str
    key: str  # in the composed config
    value: Any  # as written (a plain `${ref}` resolved)
    path: Path  # the file whose value wins
    file_key: str  # the key inside that file
    line: int | None = None
    meaning: Any = None  # what the value means for the role (`bf16: true` -> "bf16-mixed")
    note: str = ""  # an approximation the plan makes for this value

    @property
    def where(self) -> str:
        """`file:line` as printed next to the value (the file relative to the working directory when inside it)."""
        return f"{display_path(self.path)}:{self.line}" if self.line else str(display_path(self.path))


def display_path(path: Path) -> Path:
    try:
        return path.resolve().relative_to(Path.cwd().resolve())
    except (ValueError, OSError):
        return path


@dataclass(frozen=True)
class TrainingConfig:
    path: Path
    composition: Composition
    settings: Mapping[str, Setting]
    keys: Mapping[str, tuple[str, ...]]  # the keys each role was looked for at
    layout: layouts.Layout
    unread: Mapping[str, Setting]  # roles unset although a key of theirs holds a value the planner cannot use

    def get(self, role: str) -> Setting | None:
        return self.settings.get(role)

    def require(self, role: str) -> Setting:
        found = self.settings.get(role)
        if found is None:
            tried = ", ".join(self.keys[role])
            raise UserError(
                f"{self.path}: no {role} found (looked for {tried}); name its key with --key {role}=dotted.key"
            )
        return found

    def typed(self, role: str) -> tuple[Any, Setting] | tuple[None, None]:
        """The planner's value of `role` from this config and its setting, or (None, None) when the config does not
        set it. UserError for a value that cannot be what the role needs."""
        s = self.settings.get(role)
        if s is None:
            return None, None
        return _typed(s), s

    def edits(self, values: Mapping[str, yamledit.Scalar]) -> list[tuple[Path, yamledit.ValueEdit]]:
        """The edits that set each role to its value, in the file where the role's value wins."""
        out = []
        for role, value in values.items():
            s = self.require(role)
            if s.value != value or type(s.value) is not type(value):
                out.append((s.path, yamledit.ValueEdit(s.file_key, value)))
        return out


def preview_edits(edits: Sequence[tuple[Path, yamledit.ValueEdit]]) -> list[yamledit.FilePatch]:
    """One verified preview per file for edits that may come from several configs (a file edited twice the
    same way counts once)."""
    by_file: dict[Path, tuple[Path, dict[str, yamledit.ValueEdit]]] = {}
    for path, edit in edits:
        _, current = by_file.setdefault(path.resolve(), (path, {}))
        if edit.key in current and current[edit.key] != edit:
            raise UserError(f"{path}: '{edit.key}' would be set to both {current[edit.key].value} and {edit.value}")
        current[edit.key] = edit
    return [yamledit.preview(path, list(file_edits.values())) for path, file_edits in by_file.values()]


def _typed(s: Setting) -> Any:
    v = s.meaning
    if isinstance(v, str) and "${" in v:
        raise UserError(f"{s.where}: '{s.file_key}' = {v}: an interpolation the planner cannot resolve")
    role = s.role
    if role in ("batch_size", "accumulate", "seq_len", "lora_rank"):
        return _count(s, v, 1)
    if role in ("n_positives", "n_negatives"):
        return _count(s, v, 0)
    if role == "zero_stage":
        if _count(s, v, 0) > 3:
            raise UserError(f"{s.where}: '{s.file_key}' = {v!r}, expected a ZeRO stage 0, 1, 2 or 3")
        return v
    if role == "devices":
        if isinstance(v, list) and v:
            return len(v)
        if isinstance(v, str) and re.fullmatch(r"\d+(,\d+)*,?", v.strip()) and "," in v:
            return len([d for d in v.split(",") if d.strip()])
        return _count(s, int(v) if isinstance(v, str) and v.strip().isdigit() else v, 1, "a number or list of GPUs")
    if role == "gradient_checkpointing":
        if not isinstance(v, bool):
            raise UserError(f"{s.where}: '{s.file_key}' = {v!r}, expected true or false")
        return v
    if role in ("precision", "trainable"):
        allowed = PRECISIONS if role == "precision" else TRAINABLE
        if v not in allowed:  # a value the layout's translation does not know
            raise UserError(f"{s.where}: '{s.file_key}' = {s.value!r}: the planner models {', '.join(allowed)}")
        return v
    if role == "lora_targets":
        items = v.split(",") if isinstance(v, str) else v
        if not isinstance(items, (list, tuple)) or not all(isinstance(t, str) for t in items):
            raise UserError(f"{s.where}: '{s.file_key}' = {v!r}, expected a list of module names")
        names = tuple(t.strip() for t in items if t.strip())
        return ("all-linear",) if names in (("all",), ("all-linear",)) else names
    if not isinstance(v, str) or not v.strip():  # model
        raise UserError(f"{s.where}: '{s.file_key}' = {v!r}, expected a model path or Hugging Face repository id")
    return v.strip()


def _count(s: Setting, v: Any, minimum: int, what: str = "") -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        what = what or ("a positive integer" if minimum else "0 or a positive integer")
        raise UserError(f"{s.where}: '{s.file_key}' = {_brief(v)}, expected {what}")
    too_large = out_of_range("micro_batch" if s.role == "batch_size" else s.role, v)
    if too_large:
        raise UserError(f"{s.where}: '{s.file_key}' = {_brief(v)}, {too_large}")
    return int(v)


def _brief(v: Any) -> str:
    """A value as a message shows it: its start when it is long (a number of thousands of digits)."""
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:12]}… ({len(text)} characters)"


def read(path: Path, keys: Mapping[str, str] | None = None, overrides: Sequence[str] = ()) -> TrainingConfig:
    """Read a training config (composing Hydra-style defaults lists), detect its framework's layout and find every
    role's value. `keys` names a role's key explicitly (then only that key is looked at); `overrides` are group
    choices."""
    composition = compose(Path(path), overrides)
    layout = layouts.detect(composition.has_key)
    given = keys or {}
    wanted = {role: (layouts.Key(given[role]),) if role in given else layout.candidates(role) for role in ROLES}
    settings: dict[str, Setting] = {}
    unread: dict[str, Setting] = {}
    for role, candidates in wanted.items():
        for key in candidates:
            source = composition.source(key.path)
            if source is None:
                continue
            value = _resolve(composition, source.value)
            decides, meaning = key.translate(value)
            if decides:
                settings[role] = _setting(role, key, source, value, meaning)
                unread.pop(role, None)
                break
            unread.setdefault(role, _setting(role, key, source, value, None))
    tried = {role: tuple(k.path for k in candidates) for role, candidates in wanted.items()}
    return TrainingConfig(Path(path), composition, settings, tried, layout, unread)


def _setting(role: str, key: layouts.Key, source: Source, value: Any, meaning: Any) -> Setting:
    return Setting(role, key.path, value, source.layer.path, source.key, source.line, meaning, key.note)


def _resolve(composition: Composition, value: Any, depth: int = 5) -> Any:
    """The value of a plain `${dotted.key}` reference (read only: interpolations are never rewritten)."""
    match = _REFERENCE.fullmatch(value) if isinstance(value, str) else None
    if match is None or depth == 0:
        return value
    source = composition.source(match.group(1))
    return value if source is None else _resolve(composition, source.value, depth - 1)
