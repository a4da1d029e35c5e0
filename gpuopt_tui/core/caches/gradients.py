"""Where TracIn keeps projected training gradients between runs, and how they are listed and cleared.

One entry per (checkpoint content, training data, gradient settings): a folder named by the hash of those
(`entry_key`) under ``<cache dir>/tracin-gradients``, holding ``manifest.json`` (what the entry was computed from)
and one ``block_NNNNN.safetensors`` per block of training examples, each written atomically as it is finished, so
an interrupted run leaves only whole blocks behind and the next run computes the rest (and, with PCA projection
directions, ``bases.safetensors``: the directions the blocks were computed with). A block carries what it
was computed from and a checksum of its content, checked on every read (jobs/tracin/block_file.py). The checkpoint
is known by the digest of its file's content, computed anew by every run (`caches.files.file_digest`). Pure
Python (the tensors are read and written in jobs/tracin/), so the TUI and `gpuopt-tui cache` can list and clear
entries without torch. Symbolic links under the root are neither listed nor removed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuopt_tui.core import paths
from gpuopt_tui.core.caches.files import Cleared

FORMAT = 2  # 2: blocks carry their identity and checksum; checkpoints known by their content's BLAKE2b digest
MANIFEST = "manifest.json"


def default_root() -> Path:
    return paths.cache_dir() / "tracin-gradients"


def entry_key(parts: Mapping[str, Any]) -> str:
    """A stable hash of JSON-serialisable key parts."""
    text = json.dumps({"format": FORMAT, **parts}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:40]


@dataclass(frozen=True)
class GradientEntry:
    key: str
    blocks: int
    size: int  # bytes
    description: dict[str, Any]


def entries(root: Path | None = None) -> list[GradientEntry]:
    root = root or default_root()
    found = []
    for folder in sorted(root.glob("*")) if root.is_dir() else []:
        if not folder.is_dir() or folder.is_symlink():
            continue
        try:
            description = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            description = {}
        files = [p for p in folder.iterdir() if p.is_file() and not p.is_symlink()]
        blocks = sum(1 for p in files if p.name.startswith("block_") and p.suffix == ".safetensors")
        found.append(GradientEntry(folder.name, blocks, sum(p.stat().st_size for p in files), description))
    return found


def clear(root: Path | None = None) -> Cleared:
    """Delete every entry (symbolic links are kept)."""
    root = root or default_root()
    found = entries(root)
    for entry in found:
        shutil.rmtree(root / entry.key, ignore_errors=True)
    kept = sorted(p for p in root.iterdir() if p.is_symlink()) if root.is_dir() else []
    return Cleared(len(found), sum(e.size for e in found), kept)
