"""Writing files so that a reader sees the old content or the new one, never half of each."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpuopt_tui.core.errors import UserError


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` to a temporary file next to `path`, then rename it over `path`; the temporary file is
    removed if `write` fails."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_once(path: Path, write: Callable[[Path], None]) -> bool:
    """`write(tmp)` to a temporary file next to `path`, then link it as `path` unless a file is there already (one
    written by another process meanwhile is kept whole); whether this call's file is the one at `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of `data` to `fd` and fsync it (os.write may write less than asked)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.fsync(fd)


def fsync_dir(directory: Path) -> None:
    """Make a rename or link in `directory` durable, where the file system allows it."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace_file(path: Path, data: bytes) -> None:
    """Write `data` durably (fsync) next to `path`, keep an existing file's mode, and replace `path`.
    Any failure is a UserError and leaves `path` as it was."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise UserError(f"{path}: cannot write here ({e.strerror or e}); nothing was written") from None
    try:
        try:
            write_all(fd, data)
        finally:
            os.close(fd)
        if path.exists():
            shutil.copymode(path, tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise UserError(f"{path}: cannot write it ({e.strerror or e}); nothing was written") from None


def atomic_write_text(path: Path, text: str) -> None:
    replace_file(path, text.encode("utf-8"))


def write_json(path: Path, data: Any) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8"))


def write_jsonl(path: Path, records: Iterable[dict[str, Any]], written: Callable[[bytes], None] | None = None) -> None:
    """One JSON line per record; `written(line)` is called with each line's bytes as it is written."""

    def write(tmp: Path) -> None:
        with tmp.open("wb") as f:
            for record in records:
                line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
                f.write(line)
                if written is not None:
                    written(line)

    write_atomically(path, write)


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Rows of the same keys as a CSV file with a header (the first row's keys; "rank" alone for no rows)."""

    def write(tmp: Path) -> None:
        with tmp.open("w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["rank"])
            writer.writeheader()
            writer.writerows(rows)

    write_atomically(path, write)
