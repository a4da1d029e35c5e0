"""Projected training gradients of one checkpoint kept on disk (core/gradient_cache.py: layout and listing).

Features are stored in bf16; a run with the cache on rounds freshly computed features to bf16 too before using
them, so a run that reads the cache and one that fills it give identical scores.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from gpuopt_tui.core.atomic import write_atomically, write_json
from gpuopt_tui.core.feature_cache import file_sha256
from gpuopt_tui.core.gradient_cache import MANIFEST, entry_key
from gpuopt_tui.jobs.data import TextDataset
from gpuopt_tui.jobs.models.base import Adapter
from gpuopt_tui.jobs.tracin.grads import GradFeatures
from gpuopt_tui.jobs.tracin.interface import TracInOptions

STORED = torch.bfloat16


class CheckpointGradients:
    """The cached blocks of one (checkpoint, data, settings) key."""

    def __init__(self, root: Path, parts: Mapping[str, Any]) -> None:
        self.folder = root / entry_key(parts)
        self.parts = dict(parts)

    def _path(self, block: int) -> Path:
        return self.folder / f"block_{block:05d}.safetensors"

    def load(self, block: int, rows: Sequence[int], device: torch.device, dtype: torch.dtype) -> GradFeatures | None:
        """The block's features, or None when it is not stored (or was stored for other rows)."""
        path = self._path(block)
        if not path.is_file():
            return None
        try:
            tensors = load_file(str(path))
        except Exception:  # a damaged file is a miss; it is rewritten
            return None
        if tensors.get("rows") is None or tensors["rows"].tolist() != list(rows):
            return None
        outer = []
        i = 0
        while f"g{i}" in tensors:
            outer.append((tensors[f"g{i}"].to(device, dtype), tensors[f"a{i}"].to(device, dtype)))
            i += 1
        return GradFeatures(tensors["dense"].to(device, dtype), outer)

    def save(self, block: int, rows: Sequence[int], feats: GradFeatures) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        if not (self.folder / MANIFEST).is_file():
            write_json(self.folder / MANIFEST, self.parts)
        tensors = {"rows": torch.tensor(list(rows), dtype=torch.long), "dense": feats.dense.to(STORED).cpu()}
        for i, (g, a) in enumerate(feats.outer):
            tensors[f"g{i}"], tensors[f"a{i}"] = g.to(STORED).cpu(), a.to(STORED).cpu()
        write_atomically(self._path(block), lambda tmp: save_file(tensors, str(tmp)))


def rounded(feats: GradFeatures) -> GradFeatures:
    """The features as the cache stores them (bf16), in their own dtype."""
    dtype = feats.dense.dtype
    return GradFeatures(
        feats.dense.to(STORED).to(dtype), [(g.to(STORED).to(dtype), a.to(STORED).to(dtype)) for g, a in feats.outer]
    )


def cache_key(
    adapter: Adapter, train: TextDataset, params: Sequence[str], method: str, opts: TracInOptions
) -> dict[str, Any]:
    """What cached training gradients depend on besides the checkpoint."""
    digest = hashlib.sha256()
    for key in sorted(train.tensors):
        digest.update(key.encode())
        digest.update(train.tensors[key].contiguous().numpy().tobytes())
    return {
        "model": adapter.name,
        "train": digest.hexdigest(),
        "n_train": len(train),
        "parameters": list(params),
        "method": method,
        "precision": opts.precision,
        "projection": [opts.projection_dim, opts.projection_in, opts.projection_out, opts.seed],
    }


class TrainGradientCache:
    """A run's training gradients in the cache under `root`, keyed by `parts` (`cache_key`) and the checkpoint in
    use: each block read from there, or computed, rounded as stored and saved there; counts both."""

    def __init__(self, root: Path, parts: Mapping[str, Any]) -> None:
        self.root = root
        self.parts = dict(parts)
        self.read = self.computed = 0
        self._current: CheckpointGradients | None = None

    def checkpoint(self, path: Path) -> None:
        """Use the entry of this checkpoint file (by its content) from now on."""
        self._current = CheckpointGradients(self.root, {**self.parts, "checkpoint": file_sha256(path)})

    def block(
        self,
        block: int,
        rows: Sequence[int],
        device: torch.device,
        dtype: torch.dtype,
        compute: Callable[[], GradFeatures],
    ) -> GradFeatures:
        if self._current is None:
            raise RuntimeError("TrainGradientCache.block before checkpoint")
        feats = self._current.load(block, rows, device, dtype)
        if feats is not None:
            self.read += 1
            return feats
        feats = rounded(compute())
        self._current.save(block, rows, feats)
        self.computed += 1
        return feats
