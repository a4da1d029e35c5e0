"""A profile's values as a form shows, reads and checks them, one key at a time.

Numbers and lists are read the way `--set key=value` reads them (a TOML value; a bare word stays a string), so
the form, the CLI and the files accept the same things and give the same messages.
"""

from __future__ import annotations

import json
from typing import Any

from gpuopt_tui.core.errors import ProfileError
from gpuopt_tui.core.profiles.common import ProfileBase
from gpuopt_tui.core.profiles.io import parse_override, profile_from_data
from gpuopt_tui.core.profiles.schema import AUTO, FieldInfo

FORM_SOURCE = "form"


def toml_inline(value: Any) -> str:
    """A value as inline TOML (what a user types for lists and tables)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_inline(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_inline(v)}" for k, v in value.items()) + "}"
    return repr(value)


def field_text(info: FieldInfo, value: Any) -> str:
    if info.type_name == "list[str]" and isinstance(value, list):
        return ", ".join(str(v) for v in value)
    if isinstance(value, str):
        return value
    return toml_inline(value)


def parse_field(info: FieldInfo, text: str) -> Any:
    """The value typed into a field, before validation (a wrong type is left for the schema to report)."""
    if info.type_name == "str":
        return text
    text = text.strip()
    if info.auto and text == AUTO:
        return AUTO
    if info.type_name == "list[str]":
        return [part.strip() for part in text.split(",") if part.strip()]
    if not text:
        return ""
    return parse_override(f"value={text}")[1]


def set_path(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    data[leaf] = value


def build(cls: type[ProfileBase], data: dict[str, Any], source: str) -> ProfileBase:
    """Validate form data into a profile (raises ProfileError naming the key)."""
    return profile_from_data({"kind": cls.kind, **data}, source)


def field_error(cls: type[ProfileBase], key: str, value: Any) -> str:
    """The schema's complaint about one value on its own, or ""."""
    data: dict[str, Any] = {}
    set_path(data, key, value)
    try:
        build(cls, data, FORM_SOURCE)
    except ProfileError as e:
        if e.key == key or e.key.startswith(key + "["):
            return e.detail
    return ""


def row_key(key: str) -> str:
    """The field an error key belongs to: tracin.checkpoints[0].path -> tracin.checkpoints."""
    return key.split("[", 1)[0]


def select_options(info: FieldInfo) -> list[tuple[str, Any]]:
    """A chooser's (label, value) pairs: the choices, or auto / true / false for a `bool | "auto"` field (a Switch
    cannot show "auto"), whose values are what the profile holds so that a form round-trips exactly."""
    if info.choices:
        return [(c, c) for c in info.choices]
    return [(AUTO, AUTO), ("true", True), ("false", False)]


def range_text(info: FieldInfo) -> str:
    bounds = []
    if info.min is not None:
        bounds.append(f">= {info.min:g}")
    if info.max is not None:
        bounds.append(f"<= {info.max:g}")
    kind = info.type_name + (' or "auto"' if info.auto else "")
    return f"{kind}{', ' + ', '.join(bounds) if bounds else ''}"
