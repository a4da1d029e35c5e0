"""Feature extraction with the feature cache: each (representation, layer) is looked up first; the missing ones
are computed together in one pass over the samples (one forward pass per batch for a model source) and written
straight into cache entries, a batch of rows at a time, so host memory holds one batch, not the data set."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gpuopt_tui.core.feature_cache import FeatureCache, PendingEntry, cache_key
from gpuopt_tui.jobs.ablation.inputs import LayerSource
from gpuopt_tui.jobs.ablation.representations import BASES, VERSION, FeatureSettings


@dataclass
class LayerFeatures:
    representation: str  # a base representation
    layer: str
    key: str
    array: np.ndarray | None = None  # [N, f], a read-only memory map of the cache entry
    seconds: float = 0.0  # computing (or, for a hit, loading and verifying) time
    cached: bool = False


def feature_key(source: LayerSource, representation: str, layer: str, settings: FeatureSettings) -> str:
    base = BASES[representation]
    return cache_key(
        {
            "input": source.fingerprint(layer),
            "samples": source.samples,
            "representation": representation,
            "version": VERSION,
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
) -> dict[tuple[str, str], LayerFeatures]:
    """Features of every (representation, layer); `on_batch(samples done, samples)` after each computed batch
    (raise there to stop: unfinished entries are discarded)."""
    found: dict[tuple[str, str], LayerFeatures] = {}
    missing: list[LayerFeatures] = []
    for layer in layers:
        for rep in representations:
            item = LayerFeatures(rep, layer, feature_key(source, rep, layer, settings))
            t0 = time.perf_counter()
            item.array = store.load(item.key, shape=(source.samples, -1))
            item.seconds, item.cached = time.perf_counter() - t0, item.array is not None
            found[rep, layer] = item
            if item.array is None:
                missing.append(item)
    if missing:
        _compute(source, missing, settings, store, device, batch_size, on_batch)
    return found


def _compute(
    source: LayerSource,
    items: list[LayerFeatures],
    settings: FeatureSettings,
    store: FeatureCache,
    device: torch.device,
    batch_size: int,
    on_batch: Callable[[int, int], None] | None,
) -> None:
    layers = list(dict.fromkeys(item.layer for item in items))
    pending: dict[str, PendingEntry] = {}
    try:
        for start, matrices in source.batches(layers, batch_size, device):
            for item in items:
                t0 = time.perf_counter()
                values = BASES[item.representation].compute(matrices[item.layer], settings, item.layer)
                values = values.float().cpu().numpy()  # waits for the device: the time is the computation's
                item.seconds += time.perf_counter() - t0
                if item.key not in pending:
                    pending[item.key] = store.create(item.key, (source.samples, values.shape[1]))
                pending[item.key].array[start : start + len(values)] = values
            if on_batch is not None:
                on_batch(min(start + batch_size, source.samples), source.samples)
        for item in items:
            path = pending.pop(item.key).commit(
                {"representation": item.representation, "layer": item.layer, "source": source.description}
            )
            item.array = np.load(path, mmap_mode="r")
    finally:
        for entry in pending.values():
            entry.abort()
