"""What the on-disk caches share: content digests of files and buffers, a file's change stamp, whether a cache
folder can be written, and what clearing a cache did.

A digest is BLAKE2b over the BLAKE2b digests of 16 MiB chunks, hashed in parallel threads (hashlib lets go of the
GIL), so a multi-GB checkpoint or cache block is hashed at about the speed it is read. Pure Python.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from gpuopt_tui.core.errors import UserError

CHUNK = 16 << 20
_THREADS = min(8, os.cpu_count() or 1)
_DIGEST_SIZE = 32
RECENT_S = 2.0  # a file changed this recently may change again within the same timestamp tick


def _chunk_digest(chunk: bytes | memoryview) -> bytes:
    return hashlib.blake2b(chunk, digest_size=_DIGEST_SIZE).digest()


def digest_chunks(chunks: Iterable[bytes | memoryview]) -> str:
    """The digest of a sequence of chunks (the same chunks give the same digest; at most two per thread are held
    at a time)."""
    whole = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    pending: deque[Future[bytes]] = deque()
    with ThreadPoolExecutor(_THREADS, thread_name_prefix="digest") as pool:
        for chunk in chunks:
            pending.append(pool.submit(_chunk_digest, chunk))
            if len(pending) >= 2 * _THREADS:
                whole.update(pending.popleft().result())
        for future in pending:
            whole.update(future.result())
    return whole.hexdigest()


def split(view: memoryview) -> Iterator[memoryview]:
    """`view` (bytes) in CHUNK-sized pieces, without copies."""
    for start in range(0, len(view), CHUNK):
        yield view[start : start + CHUNK]


def file_digest(path: Path) -> str:
    """The digest of a file's content, read once in chunks. Raises UserError naming the file if it cannot be read."""
    try:
        with path.open("rb") as f:
            return digest_chunks(iter(lambda: f.read(CHUNK), b""))
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror or e})") from None


def stamp(path: Path) -> tuple[int, ...]:
    """What changes whenever a file is replaced or written: its device, inode, size, mtime and ctime (ns). The
    kernel sets ctime on every change of content or metadata, restoring the mtime included, and no call sets it
    back."""
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def changed_recently(path: Path) -> bool:
    return time.time() - path.stat().st_ctime < RECENT_S


def write_problem(folder: Path) -> str | None:
    """None when files can be written in `folder` (created if missing), else why not."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


@dataclass
class Cleared:
    """What clearing a cache did: entries removed, bytes freed, and the symbolic links it left alone (a link
    could lead to anything: neither it nor what it points to is the cache's to delete)."""

    removed: int = 0
    freed: int = 0
    kept: list[Path] = field(default_factory=list)
