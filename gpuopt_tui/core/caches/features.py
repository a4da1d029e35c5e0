"""The feature cache: per-layer features kept on disk between runs, keyed by what they were computed from.

An entry is two files in the cache folder: ``KEY.npy`` (the array, readable with memory mapping) and ``KEY.json``
(its manifest: format version, shape, dtype, byte size, the SHA-256 of the .npy file, creation time and a
description for listings). The key is a hash of the inputs' content fingerprint, the representation and its
parameters (`cache_key`). An entry counts only when its manifest matches the format version, the key and the
expected shape and the checksum of the array file matches; anything else is a miss, its files are removed and
the caller computes the features again.

Pure Python plus numpy (imported when an array is read or written), so the TUI can list and clear the cache
without torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuopt_tui.core import paths
from gpuopt_tui.core.atomic import atomic_write_text
from gpuopt_tui.core.caches.files import Cleared, changed_recently, file_digest, stamp
from gpuopt_tui.core.errors import UserError

if TYPE_CHECKING:
    import numpy as np

FORMAT = 1
FINGERPRINTS = "fingerprints.json"
_CHUNK = 8 << 20
IN_PROGRESS_S = 600.0  # a temporary file younger than this belongs to a write still going on


def default_root() -> Path:
    return paths.cache_dir() / "features"


def cache_key(parts: Mapping[str, Any]) -> str:
    """A stable hash of JSON-serialisable key parts (order of mapping keys does not matter)."""
    text = json.dumps({"format": FORMAT, **parts}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class CacheEntry:
    key: str
    size: int  # bytes of the array and its manifest
    created: float | None
    shape: tuple[int, ...]
    dtype: str
    description: dict[str, Any]
    ok: bool  # False: the manifest is missing or unreadable (the entry will be recomputed when next needed)


@dataclass(frozen=True)
class EntryGroup:
    """Entries of one representation computed from one source (one per layer), as listings show them."""

    representation: str  # "" for entries whose manifest cannot be read
    source: str
    layers: tuple[str, ...]  # in natural order: layer.2 before layer.10
    entries: int
    size: int
    created: float | None  # the newest entry's

    @property
    def ok(self) -> bool:
        return bool(self.representation)


def group_entries(entries: list[CacheEntry]) -> list[EntryGroup]:
    """Entries grouped by (representation, source), newest group first; unreadable entries form one group."""
    groups: dict[tuple[str, str], list[CacheEntry]] = {}
    for e in entries:
        key = (
            (str(e.description.get("representation", "?")), str(e.description.get("source", ""))) if e.ok else ("", "")
        )
        groups.setdefault(key, []).append(e)
    out = [
        EntryGroup(
            representation=representation,
            source=source,
            layers=tuple(sorted({str(e.description.get("layer", "")) for e in members}, key=natural_key)),
            entries=len(members),
            size=sum(e.size for e in members),
            created=max((e.created for e in members if e.created is not None), default=None),
        )
        for (representation, source), members in groups.items()
    ]
    return sorted(out, key=lambda g: g.created or 0.0, reverse=True)


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders the numbers inside names by value: layer.2 < layer.10."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # misses whose entry existed but was stale or damaged, and was removed
    problems: list[str] = field(default_factory=list)  # "ARRAY FILE: what was wrong" for each of those


class PendingEntry:
    """An entry being written: fill `array` (a writable memory map), then `commit` it or `abort`."""

    def __init__(self, cache: FeatureCache, key: str, shape: tuple[int, ...], dtype: str) -> None:
        import numpy as np

        self._cache, self.key = cache, key
        self._tmp = cache.root / f".{key}.{os.getpid()}.npy.tmp"
        self.array: np.ndarray = np.lib.format.open_memmap(self._tmp, mode="w+", shape=shape, dtype=dtype)

    def commit(self, description: Mapping[str, Any]) -> Path:
        """Flush the array, checksum it and move array then manifest into place (the manifest comes last, so
        a crash in between leaves an entry without manifest: a miss, never a wrong hit)."""
        self.array.flush()
        shape, dtype = tuple(int(s) for s in self.array.shape), str(self.array.dtype)
        del self.array
        manifest = {
            "format": FORMAT,
            "key": self.key,
            "shape": list(shape),
            "dtype": dtype,
            "bytes": self._tmp.stat().st_size,
            "sha256": file_sha256(self._tmp),
            "created": time.time(),
            "description": dict(description),
        }
        final = self._cache.array_path(self.key)
        os.replace(self._tmp, final)
        atomic_write_text(self._cache.manifest_path(self.key), json.dumps(manifest, indent=1))
        return final

    def abort(self) -> None:
        with contextlib.suppress(AttributeError):
            del self.array
        self._tmp.unlink(missing_ok=True)


class FeatureCache:
    """Entries under `root` (default: the user cache folder's ``features``); `stats` counts this object's
    lookups."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()
        self.stats = CacheStats()

    def array_path(self, key: str) -> Path:
        return self.root / f"{key}.npy"

    def manifest_path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    # -- reading and writing -----------------------------------------------------------------------------------
    def load(self, key: str, shape: tuple[int, ...] | None = None) -> np.ndarray | None:
        """The entry's array (read-only memory map) when it is present and valid, else None (a miss).

        `shape`: the shape the caller expects; `-1` in it matches any size along that axis. An entry that does
        not match, or whose checksum fails, is removed and counted in `stats.corrupt`."""
        import numpy as np

        manifest_file, array_file = self.manifest_path(key), self.array_path(key)
        if not manifest_file.exists():
            self.stats.misses += 1
            return None
        problem = self._check(key, manifest_file, array_file, shape)
        if problem is None:
            try:
                array = np.load(array_file, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError):
                problem = "unreadable array"
            else:
                self.stats.hits += 1
                return array
        self.stats.misses += 1
        self.stats.corrupt += 1
        self.stats.problems.append(f"{array_file}: {problem}")
        self._remove(key)
        return None

    def create(self, key: str, shape: tuple[int, ...], dtype: str = "float32") -> PendingEntry:
        self.root.mkdir(parents=True, exist_ok=True)
        return PendingEntry(self, key, shape, dtype)

    def store(self, key: str, array: np.ndarray, description: Mapping[str, Any]) -> Path:
        pending = self.create(key, tuple(array.shape), str(array.dtype))
        try:
            pending.array[...] = array
        except BaseException:
            pending.abort()
            raise
        return pending.commit(description)

    def _check(self, key: str, manifest_file: Path, array_file: Path, shape: tuple[int, ...] | None) -> str | None:
        """None when the entry is valid, else what is wrong with it."""
        try:
            manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return "unreadable manifest"
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("key") != key:
            return "manifest of another format or key"
        stored = manifest.get("shape")
        if shape is not None and (
            not isinstance(stored, list)
            or len(stored) != len(shape)
            or any(want not in (-1, got) for want, got in zip(shape, stored))
        ):
            return f"shape {stored} where {list(shape)} was expected"
        try:
            size = array_file.stat().st_size
        except OSError:
            return "array file missing"
        if size != manifest.get("bytes") or file_sha256(array_file) != manifest.get("sha256"):
            return "checksum mismatch"
        return None

    # -- listing and clearing ----------------------------------------------------------------------------------
    def entries(self) -> list[CacheEntry]:
        """Every entry, newest first; arrays without a readable manifest are listed with ok=False."""
        if not self.root.is_dir():
            return []
        found: list[CacheEntry] = []
        for array_file in filter(_regular, self.root.glob("*.npy")):
            key = array_file.stem
            manifest_file = self.manifest_path(key)
            size = _size(array_file) + _size(manifest_file)
            try:
                manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
                found.append(
                    CacheEntry(
                        key=key,
                        size=size,
                        created=float(manifest["created"]),
                        shape=tuple(int(s) for s in manifest["shape"]),
                        dtype=str(manifest["dtype"]),
                        description=dict(manifest.get("description") or {}),
                        ok=manifest.get("format") == FORMAT and manifest.get("key") == key,
                    )
                )
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
                found.append(CacheEntry(key, size, None, (), "", {}, ok=False))
        return sorted(found, key=lambda e: e.created or 0.0, reverse=True)

    def size_bytes(self) -> int:
        """Bytes used by everything the cache keeps (entries, unfinished writes, the fingerprint memo)."""
        return sum(_size(p) for p in self._own_files())

    def clear(self) -> Cleared:
        """Remove every entry, abandoned write and the fingerprint memo. Only files this cache writes are touched,
        whatever else the folder holds, and no symbolic link; a write still in progress (a temporary file touched
        in the last minutes) is left to finish, so a running probe is not broken."""
        own = self._own_files()
        cleared = Cleared(removed=sum(1 for p in own if p.suffix == ".npy"), kept=self._own_files(links=True))
        recent = time.time() - IN_PROGRESS_S
        for path in own:
            if path.name.endswith(".tmp") and _mtime(path) > recent:
                continue
            cleared.freed += _size(path)
            path.unlink(missing_ok=True)
        return cleared

    def _own_files(self, links: bool = False) -> list[Path]:
        """The files this cache writes (`links`: the symbolic links with their names instead)."""
        if not self.root.is_dir():
            return []
        patterns = ("*.npy", "*.json", ".*.tmp")
        found = [p for pattern in patterns for p in self.root.glob(pattern)]
        return sorted(p for p in found if p.is_symlink()) if links else [p for p in found if _regular(p)]

    def _remove(self, key: str) -> None:
        self.array_path(key).unlink(missing_ok=True)
        self.manifest_path(key).unlink(missing_ok=True)

    # -- content fingerprints of input files -------------------------------------------------------------------
    def file_fingerprint(self, path: Path) -> str:
        return remembered_digest(path, self.root / FINGERPRINTS)


def remembered_digest(path: Path, memo_file: Path) -> str:
    """`file_digest` of a file, remembered in `memo_file` by its `stamp` (device, inode, size, mtime, ctime), so
    that reruns on unchanged multi-GB inputs need not read them again. A file replaced or rewritten, even with its
    mtime put back, has a new ctime and is hashed anew. A file changed in the last seconds, or while it was
    hashed, is not remembered. The memo is only an accelerator: one that cannot be read or written is ignored."""
    path = Path(path).resolve()
    before = stamp(path)
    memo_key = f"{path}|{'|'.join(map(str, before))}"
    try:
        memo = json.loads(memo_file.read_text(encoding="utf-8"))
        if not isinstance(memo, dict):
            memo = {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        memo = {}
    known = memo.get(memo_key)
    if isinstance(known, str):
        return known
    digest = file_digest(path)
    if changed_recently(path) or stamp(path) != before:
        return digest
    memo = {k: v for k, v in memo.items() if not k.startswith(f"{path}|")}
    memo[memo_key] = digest
    with contextlib.suppress(OSError, UserError):
        memo_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(memo_file, json.dumps(memo, indent=1))
    return digest


def _regular(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
