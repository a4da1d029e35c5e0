"""Minimal-diff edits of values in YAML files: every byte but the edited values stays as it was.

ruamel.yaml (round-trip mode) gives the meaning and the key positions; the new value's text replaces only the
old value's text on its line (quotes kept, comments and spacing untouched). The result is parsed again and
compared with the original, leaf by leaf: only the intended keys may differ, and they must hold the intended
values; otherwise nothing is written. Values that are interpolations (`${...}`), inherited through a merge key,
shared through an anchor, or multi-line are refused with a message naming the key and the file.

Aliases are never expanded: each node is visited once, so a small file of nested aliases costs no more than its
size. A preview (FilePatch) records the SHA-256 of the bytes it was made from; `apply` writes it.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.format import human_bytes

Scalar = bool | int | float | str
Leaves = dict[tuple[str, ...], tuple[str, Any]]
# The largest config read: ruamel's round trip reads about 150 KB/s, and a plan reads a file again to check its edit
MAX_CONFIG_BYTES = 1024**2
_CACHED_TEXTS = 8  # parsed documents kept: a composed config, its stage files and the edit being checked


@dataclass(frozen=True)
class ValueEdit:
    key: str  # dotted path inside the file, e.g. "training.trainer.accumulate_grad_batches"
    value: Scalar


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    line: int  # 1-based line of the value


@dataclass(frozen=True)
class FilePatch:
    """A previewed edit of one file; apply() writes it if the file is still what the preview read."""

    path: Path
    sha256: str
    old_text: str
    new_text: str
    changes: tuple[Change, ...]

    @property
    def diff(self) -> str:
        return unified_diff(self.path, self.old_text, self.new_text)


def unified_diff(path: Path, old: str, new: str) -> str:
    lines = difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True), fromfile=f"{path}", tofile=f"{path} (new)"
    )
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines)


# --- reading -------------------------------------------------------------------------------------------------


def _parser() -> Any:
    from ruamel.yaml import YAML

    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True
    return yaml


def read_text(path: Path) -> tuple[bytes, str]:
    """The file's bytes and its text (UTF-8); UserError when it cannot be read, is not a regular file (a FIFO
    would block, a device never end) or is larger than MAX_CONFIG_BYTES."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # opening a FIFO does not wait for a writer
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"{path}: not a regular file (a FIFO, a device or a directory); expected a YAML file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_CONFIG_BYTES:
        size = max(len(raw), info.st_size)
        raise UserError(
            f"{path}: {human_bytes(size)}, larger than the {human_bytes(MAX_CONFIG_BYTES)} a training config may "
            "have; the planner reads configs, not data"
        )
    try:
        return raw, raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start})") from None


class _ParseCache:
    """The newest parsed documents by their text: reading a config, composing it and previewing an edit of it
    parse the same text once (ruamel's round trip reads about 150 KB/s). Callers treat the data as read-only."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._docs: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, text: str) -> tuple[bool, Any]:
        with self._lock:
            if text not in self._docs:
                return False, None
            self._docs.move_to_end(text)
            return True, self._docs[text]

    def put(self, text: str, data: Any) -> None:
        with self._lock:
            self._docs[text] = data
            while len(self._docs) > self._size:
                self._docs.popitem(last=False)


_parsed = _ParseCache(_CACHED_TEXTS)


def parse(text: str, source: Path | str) -> Any:
    """The round-trip data of YAML `text` (shared: do not modify it); UserError naming the file and line when it
    is not valid YAML."""
    text = text.removeprefix("\ufeff")
    found, data = _parsed.get(text)
    if not found:
        data = _load(text, source)
        _parsed.put(text, data)
    return data


def _load(text: str, source: Path | str) -> Any:
    from ruamel.yaml.error import MarkedYAMLError, YAMLError

    try:
        return _parser().load(text)
    except MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"{source}: not valid YAML{where}: {e.problem or e.context}") from None
    except YAMLError as e:
        raise UserError(f"{source}: not valid YAML: {e}") from None
    except RecursionError:
        raise UserError(f"{source}: nested too deeply to read") from None
    except ValueError as e:  # an integer of thousands of digits: Python will not convert it
        raise UserError(f"{source}: not a value the planner can read ({e})") from None
    except (AttributeError, TypeError) as e:  # ruamel.yaml fails so on a merge key (<<) inside its own anchor
        raise UserError(
            f"{source}: YAML the reader cannot build ({type(e).__name__}: {e}); a merge key (<<: *name) inside the "
            "mapping that anchor names does this"
        ) from None


def load(path: Path) -> Any:
    return parse(read_text(path)[1], path)


def lookup(data: Any, key: str, source: Path | str) -> Any:
    """The value at dotted `key`; UserError when a part is missing or not a mapping."""
    return _locate(data, key, source)[2]


def has_key(data: Any, key: str) -> bool:
    node = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _locate(data: Any, key: str, source: Path | str) -> tuple[Any, str, Any]:
    """(the mapping holding the last part, the last part, its value)."""
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts):
        where = ".".join(parts[:i]) or "the top level"
        if not isinstance(node, dict):
            raise UserError(f"{source}: '{where}' is not a mapping, so it has no key '{part}' (looking for '{key}')")
        if part not in node:
            known = ", ".join(str(k) for k in list(node)[:12])
            raise UserError(f"{source}: no key '{key}' ('{part}' is missing under {where}; there: {known})")
        if i == len(parts) - 1:
            return node, part, node[part]
        node = node[part]
    raise AssertionError("unreachable")


# --- finding a value's text ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Span:
    line: int  # 0-based
    start: int
    end: int
    quote: str  # "'", '"', or "" for a plain scalar or an alias


def _skip_quoted(line: str, i: int) -> int:
    """Index after the quoted scalar starting at line[i], or -1 when it does not end on this line."""
    q = line[i]
    j = i + 1
    while j < len(line):
        c = line[j]
        if q == '"' and c == "\\":
            j += 2
            continue
        if c == q:
            if q == "'" and j + 1 < len(line) and line[j + 1] == "'":
                j += 2
                continue
            return j + 1
        j += 1
    return -1


def _skip_blank(line: str, i: int) -> int:
    while i < len(line) and line[i] in " \t":
        i += 1
    return i


def _value_span(lines: list[str], kline: int, kcol: int, flow: bool, refuse: Callable[[str], NoReturn]) -> _Span:
    """Where the value of the key written at (kline, kcol) is in the text."""
    line = lines[kline]
    i = kcol
    if line[i : i + 1] in ("'", '"'):
        i = _skip_quoted(line, i)
        if i < 0:
            refuse("its key spans several lines")
    else:
        while i < len(line) and not (
            line[i] == ":" and (i + 1 == len(line) or line[i + 1] in " \t" or (flow and line[i + 1] in ",}]"))
        ):
            i += 1
    i = _skip_blank(line, i)
    if line[i : i + 1] != ":":
        refuse("its key is not followed by ':' on the same line")
    i = _skip_blank(line, i + 1)
    row = kline
    while i >= len(line) or line[i] == "#":  # the value is on a following, more indented line
        row += 1
        if row >= len(lines):
            refuse("it has no value")
        line = lines[row]
        i = _skip_blank(line, 0)
        if i < len(line) and line[i] != "#" and i <= kcol:
            refuse("it has no value")
    while line[i] in "&!":  # an anchor or a tag before the value: kept as they are
        while i < len(line) and line[i] not in " \t":
            i += 1
        i = _skip_blank(line, i)
        if i >= len(line):
            refuse("its value is on its own line after an anchor or tag")
    c = line[i]
    if c in "'\"":
        end = _skip_quoted(line, i)
        if end < 0:
            refuse("its quoted value spans several lines")
        return _Span(row, i, end, c)
    if c in "|>":
        refuse("it is a block scalar")
    if c in "[{":
        refuse("it is a list or a mapping, not a single value")
    stops = ",]}" if flow else ""
    j = i
    while j < len(line) and line[j] not in stops and not (line[j] == "#" and line[j - 1] in " \t"):
        j += 1
    end = len(line[:j].rstrip(" \t"))
    return _Span(row, i, end, "")


# --- rendering and checking ----------------------------------------------------------------------------------


def _norm(value: Any) -> tuple[str, Any]:
    """A comparable (type, value) pair for a parsed scalar; bool before int since bool is an int."""
    for kind in (bool, int, float, str):
        if isinstance(value, kind):
            return kind.__name__, kind(value)
    if value is None:
        return "null", None
    return type(value).__name__, str(value)


def _flatten(data: Any) -> tuple[Leaves, set[int]]:
    """Every leaf by its path, and the ids of the mappings and lists reached more than once (through an alias or
    a merge key). Each node is visited once: a later path to a visited node is one leaf naming the first path, so
    the work is linear in the file's size however the aliases nest."""
    out: Leaves = {}
    first: dict[int, tuple[str, ...]] = {}
    shared: set[int] = set()
    todo: list[tuple[tuple[str, ...], Any]] = [((), data)]
    while todo:
        prefix, node = todo.pop()
        if not isinstance(node, (dict, list)):
            out[prefix] = _norm(node)
            continue
        if id(node) in first:
            shared.add(id(node))
            out[prefix] = ("alias", ".".join(first[id(node)]))
            continue
        first[id(node)] = prefix
        items = [(str(k), v) for k, v in (node.items() if isinstance(node, dict) else enumerate(node))]
        if not items:
            out[prefix] = ("mapping" if isinstance(node, dict) else "list", None)
        todo.extend(((*prefix, k), v) for k, v in reversed(items))
    return out, shared


def _through_shared(data: Any, key: str, shared: set[int]) -> bool:
    """Whether the path to dotted `key` passes through a mapping or list that is reached more than once."""
    node = data
    for part in key.split(".")[:-1]:
        node = node[part]
        if id(node) in shared:
            return True
    return False


def _plain_text(value: Scalar, old_text: str) -> str:
    if isinstance(value, bool):
        word = "true" if value else "false"
        if old_text[:1].isupper():
            word = word.upper() if old_text.isupper() else word.capitalize()
        return word
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise UserError(f"cannot write {value} as a configuration value")
        return repr(value)
    return value


def _quoted(text: str, quote: str) -> str:
    if quote == "'":
        return "'" + text.replace("'", "''") + "'"
    return json.dumps(text)


def _render(value: Scalar, old: Any, span: _Span, old_text: str) -> tuple[str, tuple[str, Any]]:
    """The new value's text and what it must parse to. A quoted old string keeps its quotes (and stays a
    string); a string that would not read back as itself unquoted gets double quotes."""
    if span.quote and isinstance(old, str):
        text = value if isinstance(value, str) else _plain_text(value, "")
        return _quoted(text, span.quote), ("str", text)
    text = _plain_text(value, old_text)
    if isinstance(value, str):
        if not _reads_back(text, value):
            text = _quoted(value, '"')
        return text, ("str", value)
    return text, _norm(value)


def _reads_back(text: str, value: str) -> bool:
    try:
        parsed = _load(f"k: {text}\n", "value")
    except UserError:
        return False
    return isinstance(parsed, dict) and _norm(parsed.get("k")) == ("str", value)


def preview(path: Path, edits: Sequence[ValueEdit]) -> FilePatch:
    """The patch that sets each edit's key to its value in `path`, verified; the file is not touched."""
    raw, text = read_text(path)
    bom = "\ufeff" if text.startswith("\ufeff") else ""
    body = text[len(bom) :]
    data = parse(body, path)
    keys = [e.key for e in edits]
    if len(set(keys)) != len(keys):
        raise UserError(f"{path}: the same key is edited twice ({', '.join(keys)})")
    lines = body.splitlines(keepends=True)
    bare = [line.rstrip("\r\n") for line in lines]
    patches: list[tuple[_Span, str]] = []
    changes: list[Change] = []
    expected, shared = _flatten(data)
    for edit in edits:

        def refuse(why: str, key: str = edit.key) -> NoReturn:
            raise UserError(f"{path}: cannot edit '{key}': {why}; edit it by hand")

        parent, last, old = _locate(data, edit.key, path)
        if isinstance(old, (dict, list)):
            refuse("it is a mapping or a list, not a single value")
        if _through_shared(data, edit.key, shared):
            refuse(
                "it sits in a mapping shared through an anchor (&name) and its aliases, so it would change everywhere"
            )
        if isinstance(old, str) and "${" in old:
            raise UserError(
                f"{path}: '{edit.key}' is an interpolation ({old}); it is never rewritten. Edit the key it "
                "refers to, or point the planner at that key"
            )
        position = parent.lc.data.get(last) if hasattr(parent, "lc") else None
        if position is None:
            refuse("its value comes from a merge key (<<: *anchor)")
        span = _value_span(bare, position[0], position[1], parent.fa.flow_style(), refuse)
        old_text = bare[span.line][span.start : span.end]
        new_text, want = _render(edit.value, old, span, old_text)
        patches.append((span, new_text))
        changes.append(Change(edit.key, old, edit.value, span.line + 1))
        expected[tuple(edit.key.split("."))] = want
    for span, new_text in sorted(patches, key=lambda p: (p[0].line, p[0].start), reverse=True):
        line = lines[span.line]
        lines[span.line] = line[: span.start] + new_text + line[span.end :]
    new_body = "".join(lines)
    got, _ = _flatten(parse(new_body, path))
    if got != expected:
        wrong = sorted(".".join(k) for k in set(got) | set(expected) if got.get(k) != expected.get(k))
        more = f" and {len(wrong) - 8} more" if len(wrong) > 8 else ""
        raise UserError(
            f"{path}: editing {', '.join(keys)} would change {', '.join(wrong[:8])}{more} (anchors, aliases or an "
            "unusual layout); nothing was written, edit it by hand"
        )
    return FilePatch(path, hashlib.sha256(raw).hexdigest(), text, bom + new_body, tuple(changes))
