"""Composed configs (Hydra-style defaults lists): which file's value wins for a key.

A primary config may list other configs in `defaults:`; each is merged at a package (a dotted prefix), in list
order, and the config's own content goes where `_self_` stands (at the end when absent, as in Hydra 1.1+).
Supported entries: `group: option` (options may be a list or null), `group@package: option`, `/absolute/group:
option`, `optional group: option`, `override /group: option` (as experiment configs use them), plain config
names (`common`, `db/mysql`), and `# @package _global_ | _group_ | name` headers. Choices given on the command
line (`experiment=big`) override the lists. The last layer that holds a key is where its value comes from, so
that is the file to edit.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.planner import yamledit

_HEADER = re.compile(r"^\s*#\s*@package\s+(\S+)")
_MAX_PASSES = 5


@dataclass(frozen=True)
class Layer:
    path: Path
    package: str  # where the file's content lands in the composed config ("" = the top level)


@dataclass(frozen=True)
class Source:
    """Where the winning value of a key is written."""

    layer: Layer
    key: str  # the key inside layer.path
    value: Any
    line: int | None = None  # 1-based line of the key in layer.path


class Composition:
    """The layers of a composed config, in merge order (later layers win)."""

    def __init__(self, primary: Path, layers: Sequence[Layer]) -> None:
        self.primary = primary
        self.layers = tuple(layers)
        self._data: dict[Path, Any] = {}

    def data(self, path: Path) -> Any:
        if path not in self._data:
            self._data[path] = yamledit.load(path)
        return self._data[path]

    def source(self, key: str) -> Source | None:
        """The file and inner key whose value wins for dotted `key`, or None when no layer has it."""
        for layer in reversed(self.layers):
            prefix = layer.package
            if prefix:
                if not key.startswith(prefix + "."):
                    continue
                inner = key[len(prefix) + 1 :]
            else:
                inner = key
            data = self.data(layer.path)
            if inner.split(".")[0] == "defaults" and isinstance(data, dict) and isinstance(data.get("defaults"), list):
                continue
            if yamledit.has_key(data, inner):
                return Source(layer, inner, yamledit.lookup(data, inner, layer.path), _line(data, inner))
        return None

    def has_key(self, key: str) -> bool:
        return self.source(key) is not None


def _line(data: Any, key: str) -> int | None:
    """The 1-based line where dotted `key` is written (ruamel's round-trip positions), if known."""
    *parents, last = key.split(".")
    node = data
    for part in parents:
        node = node[part]
    try:
        return int(node.lc.key(last)[0]) + 1
    except (AttributeError, KeyError, TypeError):
        return None


def parse_choice(text: str) -> tuple[str, str | None]:
    """`group=option` (or `+group=option`, `group=null`) from the command line."""
    body = text.lstrip("+")
    if "=" not in body:
        raise UserError(f'override "{text}": expected group=option, e.g. experiment=big')
    group, option = body.split("=", 1)
    group = group.strip().strip("/")
    if not group:
        raise UserError(f'override "{text}": the group name is empty')
    option = option.strip()
    return group, None if option in ("null", "") else option


def compose(primary: Path, overrides: Sequence[str] = ()) -> Composition:
    """The layers of `primary` with its defaults lists expanded and command-line choices applied."""
    primary = primary.expanduser()
    root = primary.parent
    cli = dict(parse_choice(o) for o in overrides)
    choices: dict[str, Any] = dict(cli)
    for _ in range(_MAX_PASSES):
        walk = _Walk(root, choices)
        walk.expand(primary, group="", package="", stack=())
        for group, option in cli.items():  # choices for groups no defaults list names are appended
            if group not in walk.seen_groups and option is not None:
                walk.include(primary, group, option, group.replace("/", "."), optional=False, stack=())
        wanted = {**walk.found_overrides, **cli}
        if all(choices.get(g) == o for g, o in wanted.items()):
            return Composition(primary, walk.layers)
        choices = {**choices, **wanted}
    raise UserError(f"{primary}: the defaults lists keep overriding each other; cannot compose them")


class _Walk:
    def __init__(self, root: Path, choices: Mapping[str, Any]) -> None:
        self.root = root
        self.choices = choices
        self.layers: list[Layer] = []
        self.seen_groups: set[str] = set()
        self.found_overrides: dict[str, Any] = {}

    def expand(self, path: Path, group: str, package: str, stack: tuple[Path, ...]) -> None:
        if path in stack:
            raise UserError(f"{path}: its defaults list includes itself (through {', '.join(map(str, stack))})")
        _, text = yamledit.read_text(path)
        data = yamledit.parse(text, path)
        package = _header_package(text, group, package)
        defaults = data.get("defaults") if isinstance(data, dict) else None
        if not isinstance(defaults, list):  # no defaults list (a mapping called defaults is plain content)
            self.layers.append(Layer(path, package))
            return
        entries = list(defaults)
        self_at = next((i for i, e in enumerate(entries) if e == "_self_"), len(entries))
        for i, entry in enumerate(entries):
            if i == self_at:
                self.layers.append(Layer(path, package))
                continue
            self._entry(path, entry, group, package, (*stack, path))
        if self_at == len(entries):
            self.layers.append(Layer(path, package))

    def _entry(self, path: Path, entry: Any, group: str, package: str, stack: tuple[Path, ...]) -> None:
        if isinstance(entry, str):  # a plain config: "common" or "db/mysql"
            where, _, name = entry.rpartition("/")
            name, _, pkg = name.partition("@")
            target = _join_group(group, where)
            child_package = _package(pkg, target, package, _join_package(package, where.replace("/", ".")))
            self.include(path, target, name, child_package, optional=False, stack=stack)
            return
        if not isinstance(entry, dict) or len(entry) != 1:
            raise UserError(f"{path}: defaults entry {entry!r}: expected 'group: option' or a config name")
        ((head, option),) = entry.items()
        words = str(head).split()
        flags = set(words[:-1])
        spec = words[-1]
        unknown = flags - {"override", "optional"}
        if unknown:
            raise UserError(f"{path}: defaults entry '{head}': unknown keyword {', '.join(sorted(unknown))}")
        group_part, _, pkg = spec.partition("@")
        target = group_part.strip("/") if group_part.startswith("/") else _join_group(group, group_part)
        if "override" in flags:
            self.found_overrides[target] = option
            return
        self.seen_groups.add(target)
        chosen = self.choices.get(target, option)
        if chosen is None:
            return
        default_package = (
            target.replace("/", ".")
            if group_part.startswith("/")
            else _join_package(package, group_part.replace("/", "."))
        )
        child_package = _package(pkg, target, package, default_package)
        for name in chosen if isinstance(chosen, list) else [chosen]:
            self.include(path, target, str(name), child_package, optional="optional" in flags, stack=stack)

    def include(self, path: Path, group: str, name: str, package: str, optional: bool, stack: tuple[Path, ...]) -> None:
        target = self.root / group / f"{name}.yaml" if group else self.root / f"{name}.yaml"
        inside = os.path.normpath(target).startswith(os.path.join(os.path.normpath(self.root), ""))
        if not inside:  # `..` or an absolute name: a plan must never edit a file outside the config tree
            raise UserError(
                f"{path}: the defaults list names {group + '/' if group else ''}{name}, which leads to {target}, "
                f"outside the config directory {self.root}; name configs inside it"
            )
        if not target.is_file():
            yml = target.with_suffix(".yml")
            if yml.is_file():
                target = yml
            elif optional:
                return
            else:
                raise UserError(
                    f"{path}: the defaults list names {group + '/' if group else ''}{name}, but {target} does not exist"
                )
        self.expand(target, group, package, stack)


def _join_group(base: str, rel: str) -> str:
    return "/".join(p for p in (base, rel.strip("/")) if p)


def _join_package(base: str, rel: str) -> str:
    return ".".join(p for p in (base, rel) if p)


def _package(explicit: str, group: str, parent: str, default: str) -> str:
    """A package named in a defaults entry (`group@pkg`), or the default one."""
    if not explicit:
        return default
    return {"_global_": "", "_group_": group.replace("/", "."), "_here_": parent}.get(explicit, explicit)


def _header_package(text: str, group: str, package: str) -> str:
    """A `# @package` header among the leading comments overrides the package the file was included at."""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break
        match = _HEADER.match(line)
        if match:
            name = match.group(1)
            return {"_global_": "", "_group_": group.replace("/", ".")}.get(name, name)
    return package
