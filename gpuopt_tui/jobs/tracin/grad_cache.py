"""Projected training gradients of one checkpoint kept on disk (core/gradient_cache.py: layout and listing).

Features are stored in bf16; a run with the cache on rounds freshly computed features to bf16 too before using
them, so a run that reads the cache and one that fills it give identical scores.

A run that reads the cache is bound by reading the blocks, so a block is read with one copy from the file into
(page-locked, on a GPU) host memory, in a background thread while the block before it is in use, copied to the
device in bf16 and widened there. Checkpoints are keyed by their content's SHA-256, remembered by (path, size,
mtime) next to the entries, so a rerun does not read every checkpoint file twice.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from gpuopt_tui.core.atomic import write_atomically, write_json
from gpuopt_tui.core.feature_cache import remembered_sha256
from gpuopt_tui.core.gradient_cache import CHECKPOINT_HASHES, MANIFEST, entry_key
from gpuopt_tui.jobs.data import TextDataset
from gpuopt_tui.jobs.digests import dataset_digest
from gpuopt_tui.jobs.models.base import Adapter
from gpuopt_tui.jobs.tracin.grads import GradFeatures
from gpuopt_tui.jobs.tracin.interface import TracInOptions

STORED = torch.bfloat16
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64, "I64": torch.int64}

HostBlock = dict[str, Tensor]


def read_safetensors(path: Path, pin: bool) -> HostBlock:
    """The tensors of a safetensors file, read with one copy into host memory (page-locked when `pin`, so that
    copies to the GPU need no staging). Raises (OSError, ValueError, KeyError, RuntimeError) on a damaged file."""
    with path.open("rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_size))
        header.pop("__metadata__", None)
        size = max((v["data_offsets"][1] for v in header.values()), default=0)
        data = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        if f.readinto(memoryview(data.numpy())) != size:
            raise ValueError(f"{path}: shorter than its header says")
    out = {}
    for name, v in header.items():
        begin, end = v["data_offsets"]
        out[name] = data[begin:end].view(_DTYPES[v["dtype"]]).reshape(v["shape"])
    return out


class CheckpointGradients:
    """The cached blocks of one (checkpoint, data, settings) key."""

    def __init__(self, root: Path, parts: Mapping[str, Any]) -> None:
        self.folder = root / entry_key(parts)
        self.parts = dict(parts)

    def _path(self, block: int) -> Path:
        return self.folder / f"block_{block:05d}.safetensors"

    def read(self, block: int, rows: Sequence[int], pin: bool) -> HostBlock | None:
        """The block's stored tensors in host memory, or None when it is not stored (or was stored for other
        rows, or is damaged: it is then computed and written again)."""
        path = self._path(block)
        if not path.is_file():
            return None
        try:
            tensors = read_safetensors(path, pin)
        except Exception:
            return None
        if "rows" not in tensors or tensors["rows"].tolist() != list(rows):
            return None
        return tensors

    def save(self, block: int, rows: Sequence[int], feats: GradFeatures) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        if not (self.folder / MANIFEST).is_file():
            write_json(self.folder / MANIFEST, self.parts)
        tensors = {"rows": torch.tensor(list(rows), dtype=torch.long), "dense": feats.dense.to(STORED).cpu()}
        for i, (g, a) in enumerate(feats.outer):
            tensors[f"g{i}"], tensors[f"a{i}"] = g.to(STORED).cpu(), a.to(STORED).cpu()
        write_atomically(self._path(block), lambda tmp: save_file(tensors, str(tmp)))


def to_features(tensors: HostBlock, device: torch.device, dtype: torch.dtype) -> GradFeatures:
    """A stored block on `device` in `dtype`: copied as stored (bf16, asynchronously from page-locked memory),
    then widened on the device."""

    def put(t: Tensor) -> Tensor:
        return t.to(device, non_blocking=True).to(dtype)

    outer = []
    i = 0
    while f"g{i}" in tensors:
        outer.append((put(tensors[f"g{i}"]), put(tensors[f"a{i}"])))
        i += 1
    return GradFeatures(put(tensors["dense"]), outer)


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
    return {
        "model": adapter.name,
        "train": dataset_digest(train),
        "n_train": len(train),
        "parameters": list(params),
        "method": method,
        "precision": opts.precision,
        "projection": [opts.projection_dim, opts.projection_in, opts.projection_out, opts.seed],
    }


class TrainGradientCache:
    """A run's training gradients in the cache under `root`, keyed by `parts` (`cache_key`) and the checkpoint in
    use: each block read from there, or computed, rounded as stored and saved there; counts both. The blocks
    named by `expect` are read ahead in a background thread, one at a time. Use as a context manager."""

    def __init__(self, root: Path, parts: Mapping[str, Any], device: torch.device, dtype: torch.dtype) -> None:
        self.root = root
        self.parts = dict(parts)
        self.device, self.dtype = device, dtype
        self.pin = device.type == "cuda"
        self.read = self.computed = 0
        self._entries: dict[Path, CheckpointGradients] = {}
        self._current: tuple[Path, CheckpointGradients] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tracin-cache-read")
        self._plan: deque[tuple[Path, int, tuple[int, ...]]] = deque()
        self._ahead: tuple[tuple[Path, int], Future[HostBlock | None]] | None = None

    def _entry(self, path: Path) -> CheckpointGradients:
        if path not in self._entries:
            checkpoint = remembered_sha256(path, self.root / CHECKPOINT_HASHES)
            self._entries[path] = CheckpointGradients(self.root, {**self.parts, "checkpoint": checkpoint})
        return self._entries[path]

    def expect(self, plan: Iterable[tuple[Path, int, Sequence[int]]]) -> None:
        """The (checkpoint file, block, rows) that `block` will be asked for, in this order."""
        for path, block, rows in plan:
            self._entry(path)
            self._plan.append((path, block, tuple(rows)))
        self._read_ahead()

    def _read_ahead(self) -> None:
        if self._ahead is None and self._plan:
            path, block, rows = self._plan.popleft()
            self._ahead = ((path, block), self._pool.submit(self._read, self._entries[path], block, rows))

    def _read(self, entry: CheckpointGradients, block: int, rows: Sequence[int]) -> HostBlock | None:
        if not self.pin:
            return entry.read(block, rows, pin=False)
        with torch.cuda.device(self.device):  # memory is page-locked for the GPU current in the reading thread
            return entry.read(block, rows, pin=True)

    def checkpoint(self, path: Path) -> None:
        """Use the entry of this checkpoint file (by its content) from now on."""
        self._current = (path, self._entry(path))

    def block(self, block: int, rows: Sequence[int], compute: Callable[[], GradFeatures]) -> GradFeatures:
        if self._current is None:
            raise RuntimeError("TrainGradientCache.block before checkpoint")
        path, entry = self._current
        if self._ahead is not None and self._ahead[0] == (path, block):
            stored = self._ahead[1].result()
            self._ahead = None
        else:  # not announced by `expect`
            stored = self._read(entry, block, rows)
        self._read_ahead()  # the next block is read while this one is in use
        if stored is not None:
            self.read += 1
            return to_features(stored, self.device, self.dtype)
        feats = rounded(compute())
        entry.save(block, rows, feats)
        self.computed += 1
        return feats

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._plan.clear()
        self._ahead = None

    def __enter__(self) -> TrainGradientCache:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
