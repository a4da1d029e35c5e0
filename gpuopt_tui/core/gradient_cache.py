"""Where TracIn keeps projected training gradients between runs, and how they are listed and cleared.

One entry per (checkpoint content, training data, gradient settings): a folder named by the hash of those
(`entry_key`) under ``<cache dir>/tracin-gradients``, holding ``manifest.json`` (what the entry was computed from)
and one ``block_NNNNN.safetensors`` per block of training examples, each written atomically as it is finished, so
an interrupted run leaves only whole blocks behind and the next run computes the rest. ``checkpoint-hashes.json``
beside the entries remembers the checkpoint files' hashes by (path, size, mtime). Pure Python (the tensors
are read and written in jobs/tracin/grad_cache.py), so the TUI and `gpuopt-tui cache` can list and clear entries
without torch.
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

FORMAT = 1
MANIFEST = "manifest.json"
CHECKPOINT_HASHES = "checkpoint-hashes.json"


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
        if not folder.is_dir():
            continue
        try:
            description = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            description = {}
        files = [p for p in folder.iterdir() if p.is_file()]
        blocks = sum(1 for p in files if p.name.startswith("block_") and p.suffix == ".safetensors")
        found.append(GradientEntry(folder.name, blocks, sum(p.stat().st_size for p in files), description))
    return found


def clear(root: Path | None = None) -> tuple[int, int]:
    """Delete every entry; returns (entries, bytes freed)."""
    found = entries(root)
    for entry in found:
        shutil.rmtree((root or default_root()) / entry.key, ignore_errors=True)
    return len(found), sum(e.size for e in found)
