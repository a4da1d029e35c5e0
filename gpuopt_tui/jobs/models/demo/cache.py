"""A demo model's cache directory: built once, complete or absent, safe against concurrent builders.

Layout of `<cache_dir>/demo/<name>/`: whatever the builder writes, then `manifest.json` last, listing every
file with its size. A directory whose manifest is missing, unreadable, of another version or whose files do
not match is rebuilt. Builders take an exclusive lock file and build in a temporary sibling directory that
is renamed into place, so readers never see a half-built cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"


def read_manifest(root: Path, version: int) -> dict[str, Any] | None:
    """The manifest of a complete cache directory, or None when it is absent, corrupt or incomplete."""
    try:
        manifest = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("version") != version:
        return None
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return None
    for name, size in files.items():
        path = root / name
        if not path.is_file() or path.stat().st_size != size:
            return None
    return manifest


def write_manifest(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Record every file under `root` with its size, then write the manifest (atomically, last)."""
    files = {
        p.relative_to(root).as_posix(): p.stat().st_size
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {**manifest, "files": files}
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True), encoding="utf-8")
    os.replace(tmp, root / MANIFEST)
    return manifest


@contextlib.contextmanager
def _exclusive(lock_path: Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # no advisory locks (Windows): the atomic rename still keeps readers safe
        yield
        return
    with lock_path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process holds it
            if on_wait is not None:
                on_wait()
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_built(
    root: Path,
    version: int,
    build: Callable[[Path], dict[str, Any]],
    on_wait: Callable[[], None] | None = None,
) -> tuple[dict[str, Any], bool]:
    """Return (manifest, built_now) for `root`, calling `build(tmp_dir) -> manifest fields` when needed;
    `on_wait()` is called before waiting for another process that holds the lock (it is building)."""
    manifest = read_manifest(root, version)
    if manifest is not None:
        return manifest, False
    root.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(root.parent / f".{root.name}.lock", on_wait):
        manifest = read_manifest(root, version)  # another process may have finished it meanwhile
        if manifest is not None:
            return manifest, False
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
        try:
            fields = build(tmp)
            manifest = write_manifest(tmp, {**fields, "version": version})
            if root.exists():
                shutil.rmtree(root)
            try:
                os.replace(tmp, root)
            except OSError:  # without locks another builder may have won the race
                winner = read_manifest(root, version)
                if winner is None:
                    raise
                return winner, False
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return manifest, True
