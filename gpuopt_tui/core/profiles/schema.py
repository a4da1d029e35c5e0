"""Typed profile schemas: dataclasses whose fields carry help text, ranges and choices.

A profile section is a dataclass whose fields are declared with `opt(...)`; `build()` turns a parsed TOML
mapping into such an object and rejects unknown keys, wrong types and out-of-range values with a
`ProfileError` naming the source, the dotted key and what was expected. `describe()` lists the fields for
forms and help screens; `to_dict()` turns an object back into plain TOML-ready values.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal, NoReturn, Union, get_args, get_origin, get_type_hints

from gpuopt_tui.core.errors import ProfileError
from gpuopt_tui.core.format import safe_text

AUTO = "auto"


def opt(
    default: Any,
    help: str,
    *,
    min: float | None = None,
    max: float | None = None,
    choices: tuple[str, ...] | None = None,
    counts: bool = False,
) -> Any:
    """Declare a profile field. Lists and tables take their default through a copy, never shared. A text
    field with `counts` also takes a whole number, kept as its text (`devices = 2` as well as "all")."""
    meta = {"help": help, "min": min, "max": max, "choices": choices, "counts": counts}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: typing.cast(Any, default).copy(), metadata=meta)
    if is_dataclass(default):
        return field(default_factory=lambda: dataclasses.replace(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, help: str) -> Any:
    """Declare a nested section (a TOML table) holding another schema dataclass."""
    return field(default_factory=cls, metadata={"help": help, "min": None, "max": None, "choices": None})


@dataclass(frozen=True)
class FieldInfo:
    """One leaf field of a schema, as forms and help screens need it."""

    key: str  # dotted path, e.g. "attribution.n_steps"
    type_name: str  # "int", "float", "bool", "str", "list[str]", "table list"
    default: Any
    help: str
    min: float | None
    max: float | None
    choices: tuple[str, ...] | None
    auto: bool  # the string "auto" is accepted besides values of type_name


# --- type analysis -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shape:
    base: Any  # int, float, bool, str, a dataclass, or list
    item: Any = None  # element shape for lists
    auto: bool = False


def _shape(tp: Any) -> _Shape:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        auto = any(get_origin(a) is Literal and AUTO in get_args(a) for a in args)
        rest = [a for a in args if get_origin(a) is not Literal and a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"unsupported profile field type {tp!r}")
        inner = _shape(rest[0])
        return dataclasses.replace(inner, auto=auto)
    if origin is list:
        (item,) = get_args(tp)
        return _Shape(list, item=_shape(item))
    if tp in (int, float, bool, str) or is_dataclass(tp):
        return _Shape(tp)
    raise TypeError(f"unsupported profile field type {tp!r}")


def _type_name(shape: _Shape) -> str:
    if shape.base is list:
        return "table list" if is_dataclass(shape.item.base) else f"list[{_type_name(shape.item)}]"
    if is_dataclass(shape.base):
        return "table"
    return typing.cast(type, shape.base).__name__


_EXPECTED = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _describe_value(value: Any) -> str:
    """A value from a profile or `--set`, for a message: control characters as '?', long text cut."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        text = safe_text(value)
        return f'"{text}"' if len(text) <= 60 else f'"{text[:59]}…"'
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, list):
        return "a list"
    return repr(value)


# --- building ------------------------------------------------------------------------------------------------


def build(cls: type, data: Mapping[str, Any], source: str, prefix: str = "") -> Any:
    """Validate `data` against the schema dataclass `cls` and return an instance."""

    def fail(key: str, message: str) -> NoReturn:
        raise ProfileError(source, key, message)

    if not isinstance(data, Mapping):
        fail(prefix.rstrip("."), f"expected a table, got {_describe_value(data)}")
    hints = get_type_hints(cls)
    known = {f.name: f for f in fields(cls) if f.init}
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            fail(prefix + key, f"unknown key{hint} (known keys here: {', '.join(sorted(known))})")
    values: dict[str, Any] = {}
    for name, f in known.items():
        if name in data:
            values[name] = _coerce(data[name], _shape(hints[name]), f.metadata, source, prefix + name)
    obj = cls(**values)
    check = getattr(obj, "check", None)
    if callable(check):
        check(lambda key, message: fail(prefix + key, message))
    return obj


def _coerce(value: Any, shape: _Shape, meta: Mapping[str, Any], source: str, key: str) -> Any:
    def fail(message: str) -> NoReturn:
        raise ProfileError(source, key, message)

    if shape.auto and value == AUTO:
        return AUTO
    base = shape.base
    if base is list:
        if not isinstance(value, list):
            fail(f"expected a list, got {_describe_value(value)}")
        return [_coerce(v, shape.item, meta, source, f"{key}[{i}]") for i, v in enumerate(value)]
    if is_dataclass(base):
        return build(typing.cast(type, base), value, source, key + ".")
    auto_hint = ' or "auto"' if shape.auto else ""
    if base is str and meta.get("counts") and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    ok = (
        isinstance(value, bool)
        if base is bool
        else (isinstance(value, base) and not isinstance(value, bool))
        or (base is float and isinstance(value, int) and not isinstance(value, bool))
    )
    if not ok:
        fail(f"expected {_EXPECTED[base]}{auto_hint}, got {_describe_value(value)}")
    if base is float:
        value = float(value)
        if not math.isfinite(value):  # nan and inf are valid TOML, and compare false with every bound
            fail(f"expected a finite number{auto_hint}, got {value}")
    choices = meta.get("choices")
    if choices and value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        fail(f"expected one of {', '.join(choices)}, got {_describe_value(value)}{hint}")
    low, high = meta.get("min"), meta.get("max")
    if base in (int, float):
        if low is not None and value < low:
            fail(f"expected {_EXPECTED[base]} >= {low}{auto_hint}, got {value}")
        if high is not None and value > high:
            fail(f"expected {_EXPECTED[base]} <= {high}{auto_hint}, got {value}")
    return value


# --- introspection and serialisation --------------------------------------------------------------------------


def describe(cls: type, prefix: str = "") -> Iterator[FieldInfo]:
    """Yield every leaf field of `cls` (sections are walked into), in declaration order."""
    hints = get_type_hints(cls)
    defaults = cls()
    for f in fields(cls):
        if not f.init:
            continue
        shape = _shape(hints[f.name])
        if is_dataclass(shape.base):
            yield from describe(typing.cast(type, shape.base), f"{prefix}{f.name}.")
            continue
        yield FieldInfo(
            key=prefix + f.name,
            type_name=_type_name(shape),
            default=to_plain(getattr(defaults, f.name)),
            help=f.metadata.get("help", ""),
            min=f.metadata.get("min"),
            max=f.metadata.get("max"),
            choices=f.metadata.get("choices"),
            auto=shape.auto,
        )


def to_plain(value: Any, counts_as_numbers: bool = False) -> Any:
    """A schema object (or value) as plain dicts, lists and scalars. With `counts_as_numbers`, a `counts` text
    field that holds a whole number gives that number (`devices = 1`, as a profile writes it, not "1")."""
    if is_dataclass(value) and not isinstance(value, type):
        plain = {}
        for f in fields(value):
            if not f.init:
                continue
            item = getattr(value, f.name)
            number = counts_as_numbers and f.metadata.get("counts") and isinstance(item, str) and item.isdigit()
            plain[f.name] = int(item) if number else to_plain(item, counts_as_numbers)
        return plain
    if isinstance(value, list):
        return [to_plain(v, counts_as_numbers) for v in value]
    return value


def get_path(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = obj[part] if isinstance(obj, Mapping) else getattr(obj, part)
    return obj


Failure = Callable[[str, str], NoReturn]
