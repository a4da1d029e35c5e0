"""Feature extraction with the feature cache: each (representation, layer) is looked up first; the missing ones
are computed together in one pass over the samples (one forward pass per batch for a model source) and written
straight into cache entries, a batch of rows at a time, so host memory holds one batch, not the data set.

Over several processes the pass is split by sample, whatever the source: a model's forward pass gives every
layer at once, so splitting by layer would repeat it on every process, and for stored tensors a split by sample
gives equal shares without knowing what each representation costs, and keeps the spectral ones that share a
batch's singular values together. Each process looks up every world_size-th entry (the entries it owns); the
entries missing anywhere are computed by every process for its share of the batches (the batches of a
one-process run, balanced by the source's batch costs, so the features are the same bit for bit) into part
files in a folder every process reaches; after a barrier each owner joins the parts of its entries into the
cache entry. Every process then reads every entry, including those written by the others.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpuopt_tui.core.caches.features import FeatureCache, PendingEntry, cache_key
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.ablation.inputs import LayerSource
from gpuopt_tui.jobs.ablation.representations import BASES, FeatureSettings
from gpuopt_tui.jobs.context import Collective
from gpuopt_tui.jobs.sharding import balanced_owners

SHARED_CACHE = (
    "a run over several nodes needs the feature cache (GPUOPT_TUI_CACHE_DIR) on a filesystem every node shares, "
    "or ablation.use_cache = false (the features then stay in the run directory)"
)


@dataclass
class LayerFeatures:
    representation: str  # a base representation
    layer: str
    key: str
    owner: int = 0  # the process that looked the entry up and, when it was missing, wrote it
    array: np.ndarray | None = None  # [N, f], a read-only memory map of the cache entry
    seconds: float = 0.0  # computing (or, for a hit, loading and verifying) time, summed over the processes
    cached: bool = False


@dataclass(frozen=True)
class BatchShares:
    """The batches of a source (`bounds[j]`: batch j's samples [start, stop)) and the process that computes
    each, balanced by the source's batch costs."""

    size: int
    bounds: list[tuple[int, int]]
    owners: list[int]

    @classmethod
    def of(cls, source: LayerSource, batch_size: int, world_size: int) -> BatchShares:
        owners = balanced_owners(source.batch_costs(batch_size), world_size)
        return cls(batch_size, source.batch_bounds(batch_size), owners)

    def batches(self, rank: int) -> list[int]:
        return [j for j, owner in enumerate(self.owners) if owner == rank]

    def rows(self, rank: int) -> int:
        return sum(self.bounds[j][1] - self.bounds[j][0] for j in self.batches(rank))


def feature_key(source: LayerSource, representation: str, layer: str, settings: FeatureSettings) -> str:
    base = BASES[representation]
    return cache_key(
        {
            "input": source.fingerprint(layer),
            "samples": source.samples,
            "representation": representation,
            "version": base.version,
            "settings": base.settings_key(settings),
        }
    )


def extract(
    source: LayerSource,
    representations: Sequence[str],
    layers: Sequence[str],
    settings: FeatureSettings,
    store: FeatureCache,
    device: torch.device,
    batch_size: int,
    on_batch: Callable[[int, int], None] | None = None,
    *,
    dist: Collective | None = None,
    parts: Path | None = None,
) -> dict[tuple[str, str], LayerFeatures]:
    """Features of every (representation, layer), on every process of `dist` (default: this one alone);
    `on_batch(samples done, samples)` after each computed batch of this process's share (raise there to stop:
    unfinished entries are discarded). `store.stats` counts this process's lookups. `parts`: a folder every
    process reaches, for the part files (needed over several processes; removed at the end)."""
    dist = dist or Collective()
    items = [
        LayerFeatures(rep, layer, feature_key(source, rep, layer, settings), owner=i % dist.world_size)
        for i, (layer, rep) in enumerate((layer, rep) for layer in layers for rep in representations)
    ]
    for item in items:
        if item.owner == dist.rank:
            t0 = time.perf_counter()
            item.array = store.load(item.key, shape=(source.samples, -1))
            item.seconds, item.cached = time.perf_counter() - t0, item.array is not None
    missing = _missing_anywhere(items, dist)
    if missing and dist.world_size > 1:
        if parts is None:
            raise ValueError("extract over several processes needs a `parts` folder")
        _compute_in_parts(source, missing, settings, device, batch_size, on_batch, store, dist, FeatureCache(parts))
    elif missing:
        shares = BatchShares.of(source, batch_size, 1)
        _compute(source, missing, settings, device, shares, 0, on_batch, store, lambda key: key)
    _share(items, store, dist)
    if parts is not None and dist.rank == 0:
        shutil.rmtree(parts, ignore_errors=True)  # _share returned: every owner has joined its parts
    return {(item.representation, item.layer): item for item in items}


def _missing_anywhere(items: list[LayerFeatures], dist: Collective) -> list[LayerFeatures]:
    """The entries that some process's lookup missed, known to every process."""
    found = dist.gather([item.key for item in items if item.owner == dist.rank and item.array is None])
    keys = set(dist.broadcast(None if found is None else [key for part in found for key in part]))
    return [item for item in items if item.key in keys]


def _part_key(rank: int) -> Callable[[str], str]:
    return lambda key: f"{key}-rank{rank}"


def _description(source: LayerSource, item: LayerFeatures) -> dict[str, str]:
    return {"representation": item.representation, "layer": item.layer, "source": source.description}


def _compute_in_parts(
    source: LayerSource,
    items: list[LayerFeatures],
    settings: FeatureSettings,
    device: torch.device,
    batch_size: int,
    on_batch: Callable[[int, int], None] | None,
    store: FeatureCache,
    dist: Collective,
    parts: FeatureCache,
) -> None:
    """Every process computes `items` for its share of the batches into its part of each; once all are
    written, each owner joins the parts of its items into their cache entries."""
    shares = BatchShares.of(source, batch_size, dist.world_size)
    _compute(source, items, settings, device, shares, dist.rank, on_batch, parts, _part_key(dist.rank))
    dist.barrier()
    for item in items:
        if item.owner == dist.rank:
            t0 = time.perf_counter()
            _join(source, item, shares, parts, store)
            item.seconds += time.perf_counter() - t0


def _compute(
    source: LayerSource,
    items: list[LayerFeatures],
    settings: FeatureSettings,
    device: torch.device,
    shares: BatchShares,
    rank: int,
    on_batch: Callable[[int, int], None] | None,
    store: FeatureCache,
    key_of: Callable[[str], str],
) -> None:
    """Compute `items` over the batches of `rank`, their rows in batch order, into entries `key_of(item.key)`
    of `store`."""
    batches = shares.batches(rank)
    if not batches:
        return
    rows, done = shares.rows(rank), 0
    layers = list(dict.fromkeys(item.layer for item in items))
    pending: dict[str, PendingEntry] = {}
    if on_batch is not None:
        on_batch(0, rows)
    try:
        for _, matrices in source.batches(layers, shares.size, device, batches):
            for item in items:
                t0 = time.perf_counter()
                values = BASES[item.representation].compute(matrices[item.layer], settings, item.layer)
                values = values.float().cpu().numpy()  # waits for the device: the time is the computation's
                item.seconds += time.perf_counter() - t0
                if item.key not in pending:
                    pending[item.key] = store.create(key_of(item.key), (rows, values.shape[1]))
                pending[item.key].array[done : done + len(values)] = values
            done += matrices[items[0].layer].size
            if on_batch is not None:
                on_batch(done, rows)
        for item in items:
            pending.pop(item.key).commit(_description(source, item))
    finally:
        for entry in pending.values():
            entry.abort()


def _join(
    source: LayerSource, item: LayerFeatures, shares: BatchShares, parts: FeatureCache, store: FeatureCache
) -> None:
    """Put the processes' parts of `item` together, each row where it belongs, into its cache entry."""
    entry: PendingEntry | None = None
    try:
        for rank in sorted(set(shares.owners)):
            part = parts.load(_part_key(rank)(item.key), shape=(shares.rows(rank), -1))
            if part is None:
                raise UserError(
                    f"{parts.root}: the features of process {rank} for {item.representation} at {item.layer} are "
                    "missing or damaged (a run over several nodes needs its run directory on a shared filesystem)"
                )
            if entry is None:
                entry = store.create(item.key, (source.samples, part.shape[1]))
            offset = 0
            for j in shares.batches(rank):
                start, stop = shares.bounds[j]
                entry.array[start:stop] = part[offset : offset + stop - start]
                offset += stop - start
        assert entry is not None  # the batches have owners
        entry.commit(_description(source, item))
        entry = None
    finally:
        if entry is not None:
            entry.abort()


def _share(items: list[LayerFeatures], store: FeatureCache, dist: Collective) -> None:
    """Every process gets every entry, with the seconds spent on it summed over the processes and whether it
    was a hit; the gather is the sync point after which the entries that others wrote are read."""
    reports = dist.gather([(item.seconds, item.cached) for item in items])
    merged = dist.broadcast(
        None if reports is None else [(sum(s for s, _ in per), any(c for _, c in per)) for per in zip(*reports)]
    )
    for item, (seconds, cached) in zip(items, merged):
        item.seconds, item.cached = seconds, cached
        if item.array is None:
            try:
                item.array = np.load(store.array_path(item.key), mmap_mode="r")
            except FileNotFoundError:
                raise UserError(
                    f"{store.array_path(item.key)}: the feature cache entry that process {item.owner} wrote is "
                    f"missing here (cleared meanwhile, or written to another node's cache: {SHARED_CACHE})"
                ) from None
