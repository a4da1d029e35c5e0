"""attributions.index.jsonl: the byte offset, length and list fields of every line of attributions.jsonl, written
by the job after it, so that opening a run reads a few MB instead of the whole file (a 1B-model causal LM run's
jsonl is some 150 MB). This module holds the file's format and its checks; attribution.py says what the rows hold.

- line 1, the header: {"format", "jsonl": the stamp of the jsonl it indexes, "fields": the names of a row's
  values after offset and length, "corrupt" and "too_long": the lines left out, as a full read counts them}
- one JSON array per indexed line: [offset, length, *fields]
- the last line: {"sha256": the digest of every byte before it}

The stamp is the jsonl's size, its mtime in ns and the digests of its first and last EDGE_BYTES. An index that is
missing, cut short, damaged (its digest), of another format or fields, or whose stamp differs from the jsonl's (the
jsonl was written again, copied, edited) is not used: the reader reads the jsonl whole instead.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from gpuopt_tui.core.atomic import write_atomically

INDEX_SUFFIX = ".index.jsonl"
FORMAT = "gpuopt-tui-attributions-index-1"
EDGE_BYTES = 64 * 1024
# An index is smaller than its jsonl (a row holds a line's text, which the line also holds as its tokens; escaped to
# ASCII, a character takes at most twice its UTF-8 bytes): a larger file is not read.
MAX_INDEX_RATIO, INDEX_SLACK_BYTES = 2, 1024**2
_DIGEST_KEY = "sha256"


def index_path(jsonl: Path) -> Path:
    """attributions.jsonl → attributions.index.jsonl, next to it."""
    return jsonl.with_name(jsonl.stem + INDEX_SUFFIX)


def _edge_digests(f: BinaryIO, size: int) -> tuple[str, str]:
    f.seek(0)
    head = f.read(EDGE_BYTES)
    f.seek(max(0, size - EDGE_BYTES))
    tail = f.read(EDGE_BYTES)
    return hashlib.sha256(head).hexdigest(), hashlib.sha256(tail).hexdigest()


def _stamp(f: BinaryIO) -> tuple[dict[str, Any], os.stat_result]:
    """What an index records of the open jsonl `f`, and its stat."""
    st = os.fstat(f.fileno())
    head, tail = _edge_digests(f, st.st_size)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "head": head, "tail": tail}, st


def write_index(jsonl: Path, fields: Sequence[str], rows: Sequence[list[Any]], corrupt: int, too_long: int) -> None:
    """Write the index of `jsonl` (as it is on disk now) atomically next to it."""
    with jsonl.open("rb") as f:
        stamp, _ = _stamp(f)
    header = {"format": FORMAT, "jsonl": stamp, "fields": list(fields), "corrupt": corrupt, "too_long": too_long}
    lines = [json.dumps(header), *(json.dumps(row) for row in rows)]  # ASCII: any str is written
    body = ("\n".join(lines) + "\n").encode("utf-8")
    digest = json.dumps({_DIGEST_KEY: hashlib.sha256(body).hexdigest()}).encode("utf-8")
    write_atomically(index_path(jsonl), lambda tmp: tmp.write_bytes(body + digest + b"\n"))


@dataclass(frozen=True)
class LoadedIndex:
    """A valid index of a jsonl: its rows ([offset, length, *fields], in file order, not overlapping and within the
    file), the counts of lines left out, and the stat of the jsonl it was checked against."""

    path: Path
    rows: list[list[Any]]
    corrupt: int
    too_long: int
    stat: os.stat_result


def read_index(jsonl: Path, fields: Sequence[str]) -> LoadedIndex | None:
    """The index of `jsonl` when it is there, whole, of this format and these fields, and of the jsonl as it is
    now; else None."""
    path = index_path(jsonl)
    try:
        with jsonl.open("rb") as f:
            stamp, st = _stamp(f)
        with path.open("rb") as f:
            if os.fstat(f.fileno()).st_size > MAX_INDEX_RATIO * st.st_size + INDEX_SLACK_BYTES:
                return None
            data = f.read()
    except OSError:
        return None
    try:
        return _checked(path, data, fields, stamp, st)
    except (ValueError, KeyError, TypeError, IndexError, RecursionError):
        return None


def _checked(
    path: Path, data: bytes, fields: Sequence[str], stamp: dict[str, Any], st: os.stat_result
) -> LoadedIndex | None:
    cut = data.rfind(b"\n", 0, len(data) - 1) + 1
    body, last = data[:cut], data[cut:]
    if not last.endswith(b"\n") or json.loads(last)[_DIGEST_KEY] != hashlib.sha256(body).hexdigest():
        return None
    header, *lines = body.splitlines()
    head = json.loads(header)
    if head["format"] != FORMAT or head["fields"] != list(fields) or head["jsonl"] != stamp:
        return None
    corrupt, too_long = head["corrupt"], head["too_long"]
    if not all(type(n) is int and n >= 0 for n in (corrupt, too_long)):
        return None
    rows = [json.loads(line) for line in lines]
    end = 0
    for row in rows:
        if not isinstance(row, list) or len(row) != 2 + len(fields):
            return None
        offset, length = row[0], row[1]
        if type(offset) is not int or type(length) is not int or offset < end or length <= 0:
            return None
        end = offset + length
    if end > st.st_size:
        return None
    return LoadedIndex(path, rows, corrupt, too_long, st)
