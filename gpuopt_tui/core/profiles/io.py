"""Reading, overriding, finding and saving profile files.

Profiles are TOML. Loading validates them into the kind's dataclass (`schema.build`); saving keeps the
user's comments and layout (tomlkit) and replaces the file atomically.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuopt_tui.core.atomic import atomic_write_text
from gpuopt_tui.core.errors import ProfileError, UserError
from gpuopt_tui.core.kinds import KINDS
from gpuopt_tui.core.paths import shipped_profiles_dir, user_profiles_dir
from gpuopt_tui.core.profiles.common import ProfileBase
from gpuopt_tui.core.profiles.schema import build, describe, to_plain

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


@dataclass(frozen=True)
class ProfileEntry:
    """A profile file found on disk, with enough to list it (or the reason it cannot be used)."""

    name: str
    path: Path
    kind: str
    description: str
    shipped: bool
    error: str = ""


def parse_toml(text: str, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(source, "", f"not valid TOML: {e}") from None


def read_text(path: Path) -> str:
    """The file's text; a UTF-8 byte order mark (some Windows editors write one) is dropped."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise UserError(f"{path}: no such profile file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read the profile ({e})") from None


def profile_class(data: Mapping[str, Any], source: str) -> type[ProfileBase]:
    kind = data.get("kind")
    if kind is None:
        raise ProfileError(source, "kind", f"missing; expected one of: {', '.join(KINDS)}")
    if kind not in KINDS:
        close = difflib.get_close_matches(str(kind), list(KINDS), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ProfileError(source, "kind", f"unknown run kind {kind!r}{hint}; expected one of: {', '.join(KINDS)}")
    return KINDS[kind].profile


def profile_from_data(data: Mapping[str, Any], source: str) -> ProfileBase:
    cls = profile_class(data, source)
    body = {k: v for k, v in data.items() if k != "kind"}
    profile = build(cls, body, source)
    if not profile.name:
        profile.name = Path(source).stem if source.endswith(".toml") else cls.kind
    return profile


def parse_override(item: str) -> tuple[str, Any]:
    """`key=value` -> (key, value), the value read as a TOML value (a bare word stays a string)."""
    key, sep, raw = item.partition("=")
    key, raw = key.strip(), raw.strip()
    if not sep or not key:
        raise UserError(f"--set {item!r}: expected key=value, e.g. --set attribution.n_steps=100")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def apply_overrides(data: dict[str, Any], items: Iterable[str], source: str = "--set") -> dict[str, Any]:
    """Apply `--set` overrides to raw profile data (read from `source`). A key without a section is accepted
    when unambiguous."""
    _apply_overrides(data, items, source)
    return data


def _close_keys(key: str, keys: list[str]) -> list[str]:
    """Full keys close to `key`, typed with its section or without (n_step -> attribution.n_steps)."""
    by_leaf = {k.rsplit(".", 1)[-1]: k for k in keys}
    close = difflib.get_close_matches(key, [*keys, *by_leaf], n=3)
    return list(dict.fromkeys(by_leaf.get(c, c) for c in close))


def _apply_overrides(data: dict[str, Any], items: Iterable[str], source: str) -> dict[str, str]:
    """apply_overrides; returns each full key set -> its `--set key=value`, to blame for a bad value."""
    cls = profile_class(data, source)
    types = {f.key: f.type_name for f in describe(cls)}
    keys = list(types)
    applied: dict[str, str] = {}
    for item in items:
        key, value = parse_override(item)
        blame = f"--set {item.strip()}"
        if key not in keys and key != "kind":
            matches = [k for k in keys if k.rsplit(".", 1)[-1] == key]
            if len(matches) != 1:
                close = _close_keys(key, keys)
                why = f"ambiguous ({', '.join(matches)})" if matches else "no such key"
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise ProfileError(blame, key, f"{why}{hint}")
            key = matches[0]
        if types.get(key) == "str" and not isinstance(value, str):
            value = item.partition("=")[2].strip()  # e.g. target=1: the text as typed, not the number
        node = data
        *parents, leaf = key.split(".")
        for depth, part in enumerate(parents, 1):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                where = ".".join(parents[:depth])
                raise ProfileError(source, where, f"expected a table (for {blame}), got a value")
        node[leaf] = value
        applied[key] = blame
    return applied


def load_profile(path: Path, overrides: Iterable[str] = ()) -> ProfileBase:
    """Load, override and validate a profile file. An error in a value given with `--set` names the `--set`."""
    source = str(path)
    data = parse_toml(read_text(path), source)
    applied = _apply_overrides(data, overrides, source)
    try:
        return profile_from_data(data, source)
    except ProfileError as error:
        blame = next((b for key, b in applied.items() if _within(error.key, key)), None)
        if blame is None:
            raise
        raise ProfileError(blame, error.key, error.detail) from None


def keys_in_file(path: Path) -> frozenset[str]:
    """The dotted keys a profile file sets itself, its sections' names among them: a form tells them from
    defaults also where the file sets a key to its default value."""
    return frozenset(_dotted_keys(parse_toml(read_text(path), str(path))))


def _dotted_keys(data: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in data.items():
        yield prefix + key
        if isinstance(value, Mapping):
            yield from _dotted_keys(value, f"{prefix}{key}.")


def _within(key: str, overridden: str) -> bool:
    """Whether an error at `key` is about the value at `overridden` (itself, an item or a key inside it)."""
    return key == overridden or key.startswith((f"{overridden}.", f"{overridden}["))


def profile_to_toml(profile: ProfileBase) -> str:
    """A complete TOML text for a profile (the frozen copy kept in a run directory)."""
    import tomlkit  # writing only (5-6 ms to import): a screen that reads profiles is shown without it

    doc = tomlkit.document()
    doc["kind"] = profile.kind
    for key, value in to_plain(profile).items():
        doc[key] = value
    return tomlkit.dumps(doc)


_UNSET = object()


def _differences(values: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The values (tables walked into) that differ from the defaults; tables left empty are dropped."""
    found: dict[str, Any] = {}
    for key, value in values.items():
        default = defaults.get(key, _UNSET)
        if isinstance(value, Mapping) and isinstance(default, Mapping):
            inner = _differences(value, default)
            if inner:
                found[key] = inner
        elif value != default:
            found[key] = value
    return found


def _update(node: Any, values: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
    """Set values in a tomlkit container in place, keeping comments and order: keys the file has are updated
    where they changed; a key it lacks is added only where it differs from the default."""
    for key, value in values.items():
        default = defaults.get(key, _UNSET)
        if key in node and isinstance(value, Mapping) and isinstance(node[key], Mapping):
            _update(node[key], value, default if isinstance(default, Mapping) else {})
        elif key in node:
            held = node[key]
            if held != value and not (isinstance(held, str) and isinstance(value, int) and held == str(value)):
                node[key] = value  # (a count the file writes as text, devices = "2", is left as it is)
        elif isinstance(value, Mapping) and isinstance(default, Mapping):
            inner = _differences(value, default)
            if inner:
                node[key] = inner
        elif value != default:
            node[key] = value


def save_profile(profile: ProfileBase, path: Path) -> None:
    """Write `profile` to `path`: the keys its file has (comments and layout kept) and those that differ from
    the defaults, never a default the file did not set."""
    import tomlkit  # as in profile_to_toml

    try:
        original = path.read_text(encoding="utf-8-sig") if path.exists() else ""
        doc = tomlkit.parse(original) if original else tomlkit.document()
    except (OSError, tomlkit.exceptions.ParseError) as e:
        raise UserError(f"{path}: cannot update the existing file ({e})") from None
    values = {"kind": profile.kind, **to_plain(profile, counts_as_numbers=True)}
    _update(doc, values, to_plain(type(profile)(), counts_as_numbers=True))
    atomic_write_text(path, tomlkit.dumps(doc))


def profile_dirs() -> list[tuple[Path, bool]]:
    """Directories searched for profiles by name: the user's first, then the shipped ones."""
    return [(user_profiles_dir(), False), (shipped_profiles_dir(), True)]


def find_profile(name_or_path: str) -> Path:
    """A path as given, or a profile name looked up in the user's and the shipped profiles."""
    path = Path(name_or_path).expanduser()
    if path.suffix == ".toml" or os.sep in name_or_path:
        if not path.exists():
            raise UserError(f"{path}: no such profile file")
        return path
    for directory, _ in profile_dirs():
        candidate = directory / f"{name_or_path}.toml"
        if candidate.exists():
            return candidate
    names = sorted({e.name for e in list_profiles()})
    close = difflib.get_close_matches(name_or_path, names, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise UserError(f"no profile named {name_or_path!r} (give a .toml path or one of: {', '.join(names)}).{hint}")


def list_profiles() -> list[ProfileEntry]:
    """Every profile in the user's and the shipped directories; broken files are listed with their error."""
    entries: list[ProfileEntry] = []
    seen: set[str] = set()
    for directory, shipped in profile_dirs():
        if not directory.is_dir():
            continue
        for path in sorted(directory.glob("*.toml")):
            if path.stem in seen:
                continue  # a user's profile shadows a shipped one of the same name
            seen.add(path.stem)
            try:
                data = parse_toml(read_text(path), str(path))
                kind = profile_class(data, str(path)).kind
                entries.append(ProfileEntry(path.stem, path, kind, str(data.get("description", "")), shipped))
            except UserError as e:
                entries.append(ProfileEntry(path.stem, path, "?", "", shipped, error=str(e)))
    return entries
