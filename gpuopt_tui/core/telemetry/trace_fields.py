"""Checks every field of a trace sample before it becomes a Snapshot.

A trace is a file anyone may hand over, so nothing in it is trusted: each field must have its type and a
sane range, and text is kept with its control characters shown as '?' (a GPU name must never carry a
terminal escape sequence to the screen). Unknown keys are ignored, so traces of a newer version still load.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from typing import Any

from gpuopt_tui.core.format import safe_text
from gpuopt_tui.core.telemetry.fields import GpuSample
from gpuopt_tui.core.telemetry.snapshot import ProcessSample, Snapshot

MAX_COUNT = 2**63  # NVML counters are unsigned 64-bit at most; larger is corruption (and overflows floats)
MAX_TIME = 253402300799.0  # 9999-12-31 23:59:59 UTC: the last time a clock can print


class FieldError(ValueError):
    """A field of a sample that is missing or not what it should be; `field` is its path ('gpus[0].fan')."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"field '{field}': {message}")
        self.field = field


def shown(value: Any, limit: int = 40) -> str:
    """A value as JSON, cut to `limit` characters: safe to print (JSON escapes control characters)."""
    text = json.dumps(value, ensure_ascii=True, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_COUNT:
        raise FieldError(where, f"expected a whole number from 0 to 2^63, got {shown(value)}")
    return value


def _number(value: Any, where: str) -> float:
    """A measurement such as watts; NaN and infinity pass (outputs write them as null or empty)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldError(where, f"expected a number, got {shown(value)}")
    try:
        return float(value)
    except OverflowError:
        raise FieldError(where, f"expected a number, got {shown(value)}") from None


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise FieldError(where, f"expected a string, got {shown(value)}")
    return safe_text(value)


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise FieldError(where, f"expected true or false, got {shown(value)}")
    return value


# the dataclasses' annotations (strings under `from __future__ import annotations`) -> their checks
_CHECKS = {"int": _count, "float": _number, "str": _text, "bool": _flag}


def _record(cls: type, data: Any, where: str) -> Any:
    """An instance of the sample dataclass `cls` from a JSON object, every field checked."""
    if not isinstance(data, dict):
        raise FieldError(where, f"expected an object, got {shown(data)}")
    values: dict[str, Any] = {}
    for f in fields(cls):
        name = f"{where}.{f.name}"
        if f.name not in data:
            if f.default is MISSING:
                raise FieldError(name, "missing")
            continue
        value = data[f.name]
        kind, _, rest = str(f.type).partition(" | ")
        if value is None and rest == "None":
            values[f.name] = None
        else:
            values[f.name] = _CHECKS[kind](value, name)
    return cls(**values)


def _items(data: dict[str, Any], key: str) -> list[Any]:
    value = data.get(key, [])
    if not isinstance(value, list):
        raise FieldError(key, f"expected a list, got {shown(value)}")
    return value


def snapshot_from_json(data: Any) -> Snapshot:
    """A Snapshot from one parsed trace line; FieldError naming the first field that is wrong."""
    if not isinstance(data, dict):
        raise FieldError("(line)", f"expected an object, got {shown(data)}")
    if "t" not in data:
        raise FieldError("t", "missing (the sample's unix time)")
    time = data["t"]
    if isinstance(time, bool) or not isinstance(time, (int, float)) or not 0 <= time <= MAX_TIME:
        raise FieldError("t", f"expected a unix time in seconds (0 to {MAX_TIME:.0f}), got {shown(time)}")
    notes = _items(data, "notes")
    message = data.get("message", "")
    return Snapshot(
        time=float(time),
        gpus=tuple(_record(GpuSample, g, f"gpus[{i}]") for i, g in enumerate(_items(data, "gpus"))),
        processes=tuple(_record(ProcessSample, p, f"processes[{i}]") for i, p in enumerate(_items(data, "processes"))),
        message=_text(message, "message"),
        notes=tuple(_text(n, f"notes[{i}]") for i, n in enumerate(notes)),
    )
