"""A training YAML config as the planner reads and writes it: roles (batch size, accumulation, ...) found at
configurable dotted keys, in the file of a composed config whose value wins."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.planner import yamledit
from gpuopt_tui.core.planner.compose import Composition, compose
from gpuopt_tui.core.planner.estimate import TrainSetup

# Where each role is looked for, first match wins (Lightning + Hydra layouts, then flat ones).
DEFAULT_KEYS: dict[str, tuple[str, ...]] = {
    "batch_size": (
        "data_loader.batch_size",
        "data.batch_size",
        "datamodule.batch_size",
        "dataloader.batch_size",
        "training.batch_size",
        "train.batch_size",
        "batch_size",
    ),
    "accumulate": (
        "training.trainer.accumulate_grad_batches",
        "trainer.accumulate_grad_batches",
        "training.accumulate_grad_batches",
        "accumulate_grad_batches",
        "training.gradient_accumulation_steps",
        "gradient_accumulation_steps",
    ),
    "n_positives": ("data.n_positives", "data_loader.n_positives", "training.n_positives", "n_positives"),
    "n_negatives": ("data.n_negatives", "data_loader.n_negatives", "training.n_negatives", "n_negatives"),
    "precision": ("training.trainer.precision", "trainer.precision", "training.precision", "precision"),
    "seq_len": (
        "data.max_length",
        "data_loader.max_length",
        "data.max_seq_length",
        "model.max_length",
        "tokenizer.max_length",
        "max_length",
        "max_seq_length",
    ),
    "devices": ("training.trainer.devices", "trainer.devices"),
    "gradient_checkpointing": (
        "model.gradient_checkpointing",
        "training.gradient_checkpointing",
        "gradient_checkpointing",
    ),
}
ROLES = tuple(DEFAULT_KEYS)
_REFERENCE = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")
# Lightning precision names -> the planner's
PRECISION_NAMES = {
    "32": "fp32",
    "32-true": "fp32",
    "fp32": "fp32",
    "bf16": "bf16-mixed",
    "bf16-mixed": "bf16-mixed",
    "16": "fp16-mixed",
    "16-mixed": "fp16-mixed",
    "fp16": "fp16-mixed",
    "fp16-mixed": "fp16-mixed",
}


def parse_keys(items: Sequence[str]) -> dict[str, str]:
    """`role=dotted.key` items (from --key or a profile) as a mapping; UserError for unknown roles."""
    out = {}
    for item in items:
        role, sep, key = item.partition("=")
        role, key = role.strip(), key.strip()
        if not sep or not key:
            raise UserError(f'key "{item}": expected role=dotted.key, e.g. batch_size=data.train.batch_size')
        if role not in DEFAULT_KEYS:
            raise UserError(f'key "{item}": unknown role "{role}" (roles: {", ".join(ROLES)})')
        out[role] = key
    return out


@dataclass(frozen=True)
class Setting:
    role: str
    key: str  # in the composed config
    value: Any
    path: Path  # the file whose value wins
    file_key: str  # the key inside that file


@dataclass(frozen=True)
class TrainingConfig:
    path: Path
    composition: Composition
    settings: Mapping[str, Setting]
    keys: Mapping[str, tuple[str, ...]]  # the keys each role was looked for at

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

    def setup(self, base: TrainSetup) -> tuple[TrainSetup, list[str]]:
        """`base` with the values this config sets (batch, accumulation, samples per anchor, ...), and notes."""
        notes: list[str] = []
        values: dict[str, Any] = {}
        for role, field in (
            ("batch_size", "micro_batch"),
            ("accumulate", "accumulate"),
            ("n_positives", "n_positives"),
            ("n_negatives", "n_negatives"),
            ("seq_len", "seq_len"),
        ):
            s = self.settings.get(role)
            if s is not None:
                values[field] = _count(s, minimum=0 if role.startswith("n_") else 1)
        s = self.settings.get("precision")
        if s is not None:
            name = PRECISION_NAMES.get(str(s.value).lower())
            if name is None:
                notes.append(f"precision {s.value!r} ({s.path}) is not modelled; planning for {base.precision}")
            else:
                values["precision"] = name
        s = self.settings.get("devices")
        if s is not None:
            if isinstance(s.value, list):
                values["n_gpus"] = max(1, len(s.value))
            elif isinstance(s.value, int) and not isinstance(s.value, bool) and s.value > 0:
                values["n_gpus"] = s.value
            else:
                notes.append(f"devices = {s.value!r} ({s.path}): planning for {base.n_gpus} GPU(s)")
        s = self.settings.get("gradient_checkpointing")
        if s is not None and isinstance(s.value, bool):
            values["gradient_checkpointing"] = s.value
        return dataclasses.replace(base, **values), notes

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


def _count(s: Setting, minimum: int) -> int:
    v = s.value
    if isinstance(v, str) and "${" in v:
        raise UserError(f"{s.path}: '{s.file_key}' = {v}: an interpolation the planner cannot resolve")
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        what = "a positive integer" if minimum else "0 or a positive integer"
        raise UserError(f"{s.path}: '{s.file_key}' = {v!r}, expected {what}")
    return int(v)


def read(path: Path, keys: Mapping[str, str] | None = None, overrides: Sequence[str] = ()) -> TrainingConfig:
    """Read a training config (composing Hydra-style defaults lists) and find every role's value.

    `keys` names a role's key explicitly (then only that key is looked at); `overrides` are group choices."""
    composition = compose(Path(path), overrides)
    wanted = {role: ((keys or {})[role],) if role in (keys or {}) else DEFAULT_KEYS[role] for role in ROLES}
    settings = {}
    for role, candidates in wanted.items():
        for key in candidates:
            source = composition.source(key)
            if source is not None:
                value = _resolve(composition, source.value)
                settings[role] = Setting(role, key, value, source.layer.path, source.key)
                break
    return TrainingConfig(Path(path), composition, settings, wanted)


def _resolve(composition: Composition, value: Any, depth: int = 5) -> Any:
    """The value of a plain `${dotted.key}` reference (read only: interpolations are never rewritten)."""
    match = _REFERENCE.fullmatch(value) if isinstance(value, str) else None
    if match is None or depth == 0:
        return value
    source = composition.source(match.group(1))
    return value if source is None else _resolve(composition, source.value, depth - 1)
