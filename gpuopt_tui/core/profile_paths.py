"""The file paths a profile names: found by field name, made absolute and checked before a run starts."""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

from gpuopt_tui.core.errors import ProfileError
from gpuopt_tui.core.profiles.common import ProfileBase

_PATH_FIELD_NAMES = ("path", "config")
_PATH_LIST_NAMES = ("stages",)


@dataclass(frozen=True)
class _PathSlot:
    """Where one file path sits in a profile: `owner.attr`, or its item `index` when the field is a list."""

    owner: Any
    attr: str
    key: str  # dotted key as errors name it, e.g. "plan.stages[1]"
    index: int | None = None

    def get(self) -> str:
        value = getattr(self.owner, self.attr)
        return value if self.index is None else value[self.index]

    def set(self, path: str) -> None:
        if self.index is None:
            setattr(self.owner, self.attr, path)
        else:
            getattr(self.owner, self.attr)[self.index] = path


def _path_fields(obj: Any, prefix: str = "") -> list[_PathSlot]:
    """Every non-empty file path in a profile.

    Path fields are recognised by name: a string field named `path` or `config` or ending in `_path`, and each
    item of a list-of-strings field named `stages` or ending in `_paths`.
    """
    found: list[_PathSlot] = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        key = prefix + f.name
        if is_dataclass(value):
            found += _path_fields(value, f"{key}.")
        elif isinstance(value, list):
            is_path_list = f.name in _PATH_LIST_NAMES or f.name.endswith("_paths")
            for i, item in enumerate(value):
                if is_dataclass(item):
                    found += _path_fields(item, f"{key}[{i}].")
                elif is_path_list and isinstance(item, str) and item:
                    found.append(_PathSlot(obj, f.name, f"{key}[{i}]", i))
        elif isinstance(value, str) and value and (f.name in _PATH_FIELD_NAMES or f.name.endswith("_path")):
            found.append(_PathSlot(obj, f.name, key))
    return found


def resolve_paths(profile: ProfileBase, base: Path, source: str = "") -> None:
    """Make relative paths absolute (relative to the profile file's directory) and check that they exist."""
    for slot in _path_fields(profile):
        path = Path(slot.get()).expanduser()
        if not path.is_absolute():
            path = (base / path).resolve()
        slot.set(str(path))
        if not path.exists():
            raise ProfileError(source, slot.key, f"{path}: no such file or directory")
        if slot.key == "model.path" and not (path / "config.json").is_file():
            raise ProfileError(source, slot.key, f"{path}: expected a model directory with a config.json")
