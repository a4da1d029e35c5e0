"""Projected training gradients of one checkpoint kept on disk (core/caches/gradients.py: layout and listing).

Features are stored in bf16; a run with the cache on rounds freshly computed features to bf16 too before using
them, so a run that reads the cache and one that fills it give identical scores.

A run that reads the cache is bound by reading the blocks, so a block is read with one copy from the file into
(page-locked, on a GPU) host memory, in a background thread while the block before it is in use, copied to the
device in bf16 and widened there; its identity and checksum are checked there too (block_file.py). A block that
fails is computed again and rewritten, with a warning naming its file.

Checkpoints are known by the digest of their file's content, read by every run before its first block (about as
long as loading the checkpoint once more, mostly from the page cache): a file replaced or rewritten in place, its
size and mtime put back, gets its own entry. A checkpoint whose file changes during the run (its `stamp` differs
when it is loaded) is scored without the cache. A cache that cannot be written (a file where its folder should be,
a read-only folder, a full disk) leaves the run going without storing blocks, with one warning. Adam-preconditioned
gradients are known by their optimizer file's digest too (the checkpoint's `companion`), and keep each example's
<Γ(g), g> beside them. Gradients projected along directions fitted to the data (projection_basis = pca) keep those
directions beside them (`BASES`), read when the entry is first named; a block names the directions' digest, so it is
used only with the directions it was computed with (directions fitted again give other blocks). The ranks of one run
each fit them; the first to store them wins, and every rank uses those.
"""

from __future__ import annotations

import json
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import Tensor

from gpuopt_tui.core.atomic import write_atomically, write_json, write_once
from gpuopt_tui.core.caches.files import file_digest, stamp
from gpuopt_tui.core.caches.gradients import FORMAT, MANIFEST, entry_key
from gpuopt_tui.jobs.data import TextDataset
from gpuopt_tui.jobs.digests import dataset_digest
from gpuopt_tui.jobs.models.base import Adapter
from gpuopt_tui.jobs.tracin.block_file import (
    SELF_DOT,
    STORED,
    HostBlock,
    checksum,
    read_block,
    read_checked,
    write_block,
)
from gpuopt_tui.jobs.tracin.grads import GradFeatures
from gpuopt_tui.jobs.tracin.interface import TracInOptions

Stored = tuple[HostBlock | None, str | None]  # a block read from the cache, or what was wrong with its file
BASES = "bases.safetensors"  # an entry's projection directions (projection_basis = pca)


class CheckpointGradients:
    """The cached blocks of one (checkpoint, data, settings) key."""

    def __init__(self, root: Path, parts: Mapping[str, Any]) -> None:
        self.key = entry_key(parts)
        self.folder = root / self.key
        self.parts = dict(parts)
        # projection_basis = pca: the directions the blocks are computed with, read with the entry (a block's
        # identity names them: "none" until they are read or stored, so that no block is used without them)
        self.bases_digest: str | None = None
        self.stored_bases: dict[tuple[str, int], Tensor] | None = None
        self.bases_problem: str | None = None  # what is wrong with their file
        if "projection_basis" in self.parts:
            self.bases_digest = "none"
            self.stored_bases, self.bases_problem = self._read_bases()

    def path(self, block: int) -> Path:
        return self.folder / f"block_{block:05d}.safetensors"

    def identity(self, block: int) -> dict[str, str]:
        """What a block file of this entry says it was computed from (block_file.py)."""
        readable = {k: json.dumps(self.parts[k]) for k in ("checkpoint", "train", "projection") if k in self.parts}
        bases = {"bases": self.bases_digest} if self.bases_digest is not None else {}
        return {"format": str(FORMAT), "entry": self.key, "block": str(block), **readable, **bases}

    def _read_bases(self) -> tuple[dict[tuple[str, int], Tensor] | None, str | None]:
        """The projection directions stored with the blocks, or None with what is wrong with their file (None when
        there is none); the blocks' identity names them from then on."""
        tensors, problem = read_checked(self.folder / BASES, self._bases_identity(), pin=False)
        if tensors is None:
            return None, problem
        self.bases_digest = checksum({}, tensors)
        return {(name, int(axis)): t for key, t in tensors.items() for axis, name in [key.split(":", 1)]}, None

    def save_bases(self, bases: Mapping[tuple[str, int], Tensor]) -> dict[tuple[str, int], Tensor]:
        """Store the projection directions the blocks are computed with, and return those to use: these, or the ones
        another process (a rank of the same run) stored first, which every process then uses; a damaged file is
        replaced. Raises OSError when the folder cannot be written."""
        tensors = {f"{axis}:{name}": t.detach().cpu().contiguous() for (name, axis), t in sorted(bases.items())}
        self._made()
        identity = self._bases_identity()
        path, write = self.folder / BASES, lambda tmp: write_block(tmp, identity, tensors)
        if self.bases_problem is not None:  # damaged: replaced
            write_atomically(path, write)
        elif not write_once(path, write):
            stored, _ = self._read_bases()
            if stored is not None:
                return stored
            write_atomically(path, write)
        self.bases_digest = checksum({}, tensors)
        return dict(bases)

    def _made(self) -> None:
        """The entry's folder with its manifest; raises OSError when they cannot be written."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if not (self.folder / MANIFEST).is_file():
            write_json(self.folder / MANIFEST, self.parts)

    def _bases_identity(self) -> dict[str, str]:
        return {"format": str(FORMAT), "entry": self.key, "bases": "projection directions"}

    def read(self, block: int, rows: Sequence[int], pin: bool) -> Stored:
        """The block's stored tensors in host memory, or None with what is wrong with its file (None when it
        is simply not stored): see `read_block`."""
        return read_block(self.path(block), self.identity(block), rows, pin)

    def save(self, block: int, rows: Sequence[int], feats: GradFeatures) -> None:
        """Store the block (replacing a damaged file); raises OSError when the folder cannot be written."""
        self._made()
        tensors = {"rows": torch.tensor(list(rows), dtype=torch.long), "dense": feats.dense.to(STORED).cpu()}
        for i, (g, a) in enumerate(feats.outer):
            tensors[f"g{i}"], tensors[f"a{i}"] = g.to(STORED).cpu(), a.to(STORED).cpu()
        if feats.self_dot is not None:
            tensors[SELF_DOT] = feats.self_dot.to(STORED).cpu()
        identity = self.identity(block)
        write_atomically(self.path(block), lambda tmp: write_block(tmp, identity, tensors))


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
    return GradFeatures(put(tensors["dense"]), outer, put(tensors[SELF_DOT]) if SELF_DOT in tensors else None)


def rounded(feats: GradFeatures) -> GradFeatures:
    """The features as the cache stores them (bf16), in their own dtype."""
    dtype = feats.dense.dtype

    def rounded(t: Tensor) -> Tensor:
        return t.to(STORED).to(dtype)

    self_dot = rounded(feats.self_dot) if feats.self_dot is not None else None
    return GradFeatures(rounded(feats.dense), [(rounded(g), rounded(a)) for g, a in feats.outer], self_dot)


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
        **({"adapter_base": opts.adapter_base} if opts.adapter_base is not None else {}),
        **({"optimizer_state": opts.optimizer_state} if opts.optimizer_state != "off" else {}),
        **({"projection_basis": ["pca", opts.pca_examples]} if opts.projection_basis == "pca" else {}),
    }


class TrainGradientCache:
    """A run's training gradients in the cache under `root`, keyed by `parts` (`cache_key`) and the checkpoint in
    use: each block read from there, or computed, rounded as stored and saved there; counts both. The blocks
    named by `expect` are read ahead in a background thread, one at a time. `warn(message)` hears of damaged
    blocks and of a cache that cannot be written. `companions`: a file per checkpoint that the gradients depend on
    too (its optimizer state). Use as a context manager."""

    def __init__(
        self,
        root: Path,
        parts: Mapping[str, Any],
        device: torch.device,
        dtype: torch.dtype,
        warn: Callable[[str], None] = warnings.warn,
        companions: Mapping[Path, Path] | None = None,
    ) -> None:
        self.root = root
        self.companions = dict(companions or {})
        self.parts = dict(parts)
        self.device, self.dtype = device, dtype
        self.warn = warn
        self.pin = device.type == "cuda"
        self.read = self.computed = 0
        self.writable = True  # until a write fails
        self._entries: dict[Path, tuple[tuple[tuple[int, ...], ...], CheckpointGradients]] = {}
        self._current: tuple[Path, CheckpointGradients | None] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tracin-cache-read")
        self._plan: deque[tuple[Path, int, tuple[int, ...]]] = deque()
        self._ahead: tuple[tuple[Path, int], Future[Stored]] | None = None

    def _entry(self, path: Path) -> CheckpointGradients:
        if path not in self._entries:
            before = self._stamps(path)  # taken first: a change while the files are hashed shows when it is loaded
            parts = {**self.parts, "checkpoint": file_digest(path)}
            if path in self.companions:
                parts["companion"] = file_digest(self.companions[path])
            self._entries[path] = (before, CheckpointGradients(self.root, parts))
        return self._entries[path][1]

    def _stamps(self, path: Path) -> tuple[tuple[int, ...], ...]:
        return tuple(stamp(p) for p in (path, self.companions.get(path)) if p is not None)

    def expect(self, plan: Iterable[tuple[Path, int, Sequence[int]]]) -> None:
        """The (checkpoint file, block, rows) that `block` will be asked for, in this order."""
        for path, block, rows in plan:
            self._entry(path)
            self._plan.append((path, block, tuple(rows)))
        self._read_ahead()

    def _read_ahead(self) -> None:
        if self._ahead is None and self._plan:
            path, block, rows = self._plan.popleft()
            self._ahead = ((path, block), self._pool.submit(self._read, self._entries[path][1], block, rows))

    def _read(self, entry: CheckpointGradients, block: int, rows: Sequence[int]) -> Stored:
        if not self.pin:
            return entry.read(block, rows, pin=False)
        with torch.cuda.device(self.device):  # memory is page-locked for the GPU current in the reading thread
            return entry.read(block, rows, pin=True)

    def checkpoint(self, path: Path) -> None:
        """Use the entry of this checkpoint file (by its content) from now on; none if the file changed since
        its content was hashed (call this once it is loaded)."""
        entry = self._entry(path)
        if self._stamps(path) != self._entries[path][0]:
            self.warn(f"{path} changed during the run: its training gradients are computed without the cache")
            entry = None
        self._current = (path, entry)

    def bases(self, fit: Callable[[], dict[tuple[str, int], Tensor]]) -> dict[tuple[str, int], Tensor]:
        """The current checkpoint's projection directions (projection_basis = pca): those its blocks were stored with,
        else `fit()`'s, stored for later runs; its blocks count as stored with them only from then on."""
        entry = self._current[1] if self._current is not None else None
        if entry is None:
            return fit()
        if entry.stored_bases is not None:
            return {key: t.to(self.device) for key, t in entry.stored_bases.items()}
        if entry.bases_problem is not None:
            problem = entry.bases_problem
            self.warn(f"{entry.folder / BASES}: {problem}; the directions are fitted and the blocks computed again")
        bases = fit()
        try:
            return {key: t.to(self.device) for key, t in entry.save_bases(bases).items()}
        except OSError as e:
            self._cannot_write(e)
        return bases

    def block(self, block: int, rows: Sequence[int], compute: Callable[[], GradFeatures]) -> GradFeatures:
        if self._current is None:
            raise RuntimeError("TrainGradientCache.block before checkpoint")
        path, entry = self._current
        ahead = self._ahead
        if ahead is not None and ahead[0] == (path, block):
            self._ahead = None
            found = ahead[1].result()
        else:  # not announced by `expect`
            found = self._read(entry, block, rows) if entry is not None else (None, None)
        self._read_ahead()  # the next block is read while this one is in use
        stored, problem = found if entry is not None else (None, None)
        if stored is not None:
            self.read += 1
            return to_features(stored, self.device, self.dtype)
        if problem is not None and entry is not None:
            self.warn(f"{entry.path(block)}: {problem}; not used: its gradients are computed again")
        feats = rounded(compute())
        self.computed += 1
        if entry is not None:
            self._save(entry, block, rows, feats)
        return feats

    def _save(self, entry: CheckpointGradients, block: int, rows: Sequence[int], feats: GradFeatures) -> None:
        if not self.writable:
            return
        try:
            entry.save(block, rows, feats)
        except OSError as e:
            self._cannot_write(e)

    def _cannot_write(self, error: OSError) -> None:
        """Stop storing anything, with one warning."""
        if not self.writable:
            return
        self.writable = False
        self.warn(
            f"{self.root}: cannot store TracIn training gradients there ({error.strerror or error}); the run goes "
            "on without storing them. Make it a writable folder (GPUOPT_TUI_CACHE_DIR moves the cache) or set "
            "tracin.train_cache = false"
        )

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
