"""Checked reads of the fields of a JSON or CSV record from a result file: each raises RecordError naming the
field and what was expected; the caller adds the file and the line."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class RecordError(ValueError):
    """A record that does not have the expected fields (the reader adds the file and the line)."""


def get_field(row: Mapping[str, Any], key: str) -> Any:
    if key not in row:
        raise RecordError(f"no {key!r}")
    return row[key]


def as_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise RecordError(f"{name}: expected an integer, found {value!r}")
    try:
        return int(value)
    except ValueError:
        raise RecordError(f"{name}: expected an integer, found {value!r}") from None


def as_float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise RecordError(f"{name}: expected a number, found {value!r}")
    try:
        return float(value)
    except ValueError:
        raise RecordError(f"{name}: expected a number, found {value!r}") from None


def as_optional_float(value: Any, name: str) -> float | None:
    return None if value is None or value == "" else as_float(value, name)  # "": how the CSV writes None


def as_text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise RecordError(f"{name}: expected a text, found {value!r}")
    return value


def as_label(value: Any, name: str) -> int | None:
    return None if value is None or value == "" else as_int(value, name)


def as_flag(value: Any, name: str) -> bool | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        return value
    if value in ("True", "False"):  # how the CSV writes them
        return value == "True"
    raise RecordError(f"{name}: expected true or false, found {value!r}")


def as_texts(value: Any, name: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise RecordError(f"{name}: expected a list, found {type(value).__name__}")
    return tuple(as_text(item, f"{name}[{i}]") for i, item in enumerate(value))


def as_object(value: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise RecordError(f"{name}: expected an object, found {type(value).__name__}")
    return value
