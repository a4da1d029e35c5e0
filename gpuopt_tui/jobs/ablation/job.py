"""The layer probing engine: `run_job(profile, ctx)`.

Steps: open the source, pick the layers (layer_fraction, evenly spaced), get every base representation's
features per layer (feature cache first), then train num_runs MLP probes per (representation, layer) on a
shared stratified train/val/test split. Probes of the same feature width train together as one batched
ensemble. Every finished probe is saved as a shard (for resume) and reported as a metric event "probe_test_acc"
(with representation, layer, std; never throttled) besides the progress events; features as "feature_seconds".
The table representation x layer -> accuracy mean/std and time goes to results/results.json and results.csv.

Over several processes (torchrun), features.py splits the extraction by sample and every process reads every
feature entry; the pending probes are then split between the processes by cost, each saving its shards, and
after the last one is written rank 0 reads them all and writes the result files, as one process would. A
probe's initialisation, batch order and dropout masks come from the run seed and its run index alone, whichever
probes train beside it, so the processes' results are those of one process.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from gpuopt_tui.core.caches.features import CacheStats, FeatureCache
from gpuopt_tui.core.caches.files import write_problem
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.ablation import AblationProfile, AblationSection, split_representation
from gpuopt_tui.core.results.ablation import ALL_LAYERS, ResultRow, best_of, write_results
from gpuopt_tui.jobs.ablation.features import LayerFeatures, extract
from gpuopt_tui.jobs.ablation.inputs import LayerSource, open_source
from gpuopt_tui.jobs.ablation.probe import (
    FeatureTable,
    MemberResult,
    ProbeSettings,
    Split,
    stratified_split,
    train_probes,
)
from gpuopt_tui.jobs.ablation.representations import FeatureSettings
from gpuopt_tui.jobs.context import WRITE_STAGE, JobContext, ResumePart
from gpuopt_tui.jobs.device import amp_dtype_supported, resolve_device
from gpuopt_tui.jobs.sharding import mine

QUICK_RUNS = 3
DEVICE_SHARE = 0.5  # of free GPU memory that resident probe features may take
HOST_GROUP_BYTES = 4 << 30  # features of one batched group when training on the CPU
ACTIVATION_ELEMENTS = 1 << 27  # members x batch x hidden of one batched group
FEATURE_PARTS = "feature-parts"  # in the state directory: each process's rows of the features being computed


@dataclass(frozen=True)
class ProbeTask:
    representation: str
    base: str
    layer: str  # a layer name, or ALL_LAYERS
    layer_index: int | None
    inputs: tuple[str, ...]  # layers whose base features are concatenated

    @property
    def shard(self) -> str:
        return "probe-" + re.sub(r"[^A-Za-z0-9_.-]", "_", f"{self.representation}-{self.layer}") + ".json"


def sample_layers(count: int, fraction: float) -> list[int]:
    """Indices of round(count * fraction) layers (at least one), evenly spaced, first and last included."""
    keep = max(1, round(count * fraction))
    if keep >= count:
        return list(range(count))
    if keep == 1:
        return [count - 1]
    return sorted({round(i * (count - 1) / (keep - 1)) for i in range(keep)})


def probe_tasks(representations: Sequence[str], layers: Sequence[str], index_of: dict[str, int]) -> list[ProbeTask]:
    tasks = []
    for name in representations:
        base, variant = split_representation(name)
        if variant == "_all_layers":
            tasks.append(ProbeTask(name, base, ALL_LAYERS, None, tuple(layers)))
            continue
        for i, layer in enumerate(layers):
            inputs = tuple(layers[: i + 1]) if variant == "_cumulative" else (layer,)
            tasks.append(ProbeTask(name, base, layer, index_of[layer], inputs))
    return tasks


def run_job(profile: AblationProfile, ctx: JobContext) -> dict[str, Any]:
    cfg = profile.ablation
    device = resolve_device(profile.run.device)
    store = _feature_store(cfg.use_cache, ctx)
    source = open_source(profile, device, store, ctx.cache_dir, ctx.stage)
    ctx.log(f"inputs: {source.description}")
    index_of = {layer: i for i, layer in enumerate(source.layers)}
    layers = [source.layers[i] for i in sample_layers(len(source.layers), cfg.layer_fraction)]
    tasks = probe_tasks(cfg.representations, layers, index_of)
    bases = list(dict.fromkeys(t.base for t in tasks))
    ctx.log(f"probing {len(layers)} of {len(source.layers)} layers, {len(cfg.representations)} representations")

    split = stratified_split(source.labels, cfg.val_fraction, cfg.test_fraction, profile.run.seed)
    _check_split(split, source)
    settings = _probe_settings(cfg, profile.run.seed, device, ctx)
    extraction = FeatureSettings(cfg.top_k, cfg.svd_oversample, cfg.svd_niter, cfg.projection_dim, profile.run.seed)
    _check_plan(ctx, profile, source, layers, settings, extraction)
    features = _features(source, bases, layers, extraction, cfg, store, device, ctx)
    trained = _probe_pending(tasks, features, source, split, settings, device, ctx)
    reports = ctx.dist.gather(store.stats)  # returns once every process's probe shards are written
    if reports is None:  # processes other than rank 0 are done: rank 0 writes the results
        return {"probes": trained}
    stats = _merged(reports)
    rows = [ResultRow(**json.loads(ctx.shard_path(t.shard).read_text())) for t in tasks]

    test_labels = source.labels[split.test]
    info = {
        "source": source.description,
        "layers": layers,
        "source_layers": len(source.layers),
        "representations": list(cfg.representations),
        "samples": source.samples,
        "classes": source.classes,
        "class_values": source.class_values,
        "chance_acc": float(torch.bincount(test_labels).max()) / len(test_labels),
        "split": {"train": len(split.train), "val": len(split.val), "test": len(split.test)},
        "num_runs": settings.num_runs,
        "device": str(device),
        "precision": settings.precision,
        "cache": asdict(stats) | {"enabled": cfg.use_cache},
    }
    ctx.stage(WRITE_STAGE)
    json_path, csv_path = write_results(ctx.results_dir, info, rows)
    ctx.artifact(json_path, "probe accuracy per representation and layer (JSON)")
    ctx.artifact(csv_path, "probe accuracy per representation and layer (CSV)")
    if not cfg.use_cache:
        shutil.rmtree(store.root, ignore_errors=True)
    best = {}
    for name, top in best_of(rows).items():  # selected on validation; test reported once, for that layer
        best[name] = {
            "layer": top.layer,
            "val_acc": round(top.val_acc_mean, 4),
            "test_acc": round(top.test_acc_mean, 4),
        }
        ctx.log(
            f"{name}: layer {top.layer} selected on validation accuracy {top.val_acc_mean:.3f}; "
            f"its test accuracy {top.test_acc_mean:.3f} ± {top.test_acc_std:.3f}"
        )
    ctx.repeat_progress("probes")  # run lists show the probes, not the last stage
    return {"probes": len(rows), "best": best, "cache_hits": stats.hits, "cache_misses": stats.misses}


def _merged(stats: list[CacheStats]) -> CacheStats:
    """The cache statistics of every process's lookups (each process looks up its own share of the entries)."""
    return CacheStats(
        hits=sum(s.hits for s in stats),
        misses=sum(s.misses for s in stats),
        corrupt=sum(s.corrupt for s in stats),
        problems=[problem for s in stats for problem in s.problems],
    )


def _feature_store(use_cache: bool, ctx: JobContext) -> FeatureCache:
    """The feature cache, or the run's own folder when the cache is off or cannot be written there."""
    if use_cache:
        root = ctx.cache_dir / "features"
        problem = write_problem(root)
        if problem is None:
            return FeatureCache(root)
        ctx.warn(
            f"{root}: cannot keep the feature cache there ({problem}); the run goes on without it. Make it a "
            "writable folder (GPUOPT_TUI_CACHE_DIR moves the cache) or set ablation.use_cache = false"
        )
    return FeatureCache(ctx.state_dir / "features")


def _check_plan(
    ctx: JobContext,
    profile: AblationProfile,
    source: LayerSource,
    layers: list[str],
    probes: ProbeSettings,
    extraction: FeatureSettings,
) -> None:
    """Probe shards of an earlier attempt are reused only if they were made from the same layers and labels
    (the model, data and tokenizer they come from) with the same settings."""
    cfg = profile.ablation
    settings = {
        **asdict(probes),
        "features": asdict(extraction),
        "split": [cfg.val_fraction, cfg.test_fraction],
        "representations": list(cfg.representations),
        "layers": layers,
    }
    parts = source.resume_parts(profile.model, ctx.cache_dir)
    ctx.check_resume_record({**parts, "settings": ResumePart(settings, "the settings")})


def _features(
    source: LayerSource,
    bases: list[str],
    layers: list[str],
    settings: FeatureSettings,
    cfg: AblationSection,
    store: FeatureCache,
    device: torch.device,
    ctx: JobContext,
) -> dict[tuple[str, str], LayerFeatures]:
    ctx.stage("looking up cached features")

    def on_batch(done: int, total: int) -> None:
        ctx.check_cancelled()
        if done:
            ctx.first_batch_done()  # before the progress, whose new stage would start a stage of its own
        ctx.progress(done, total, unit="samples", stage="features")

    features = extract(
        source,
        bases,
        layers,
        settings,
        store,
        device,
        cfg.extract_batch_size,
        on_batch,
        dist=ctx.dist,
        parts=ctx.state_dir / FEATURE_PARTS,
    )
    for item in features.values():
        if item.owner == ctx.rank:
            ctx.metric(
                "feature_seconds",
                round(item.seconds, 4),
                representation=item.representation,
                layer=item.layer,
                cached=item.cached,
            )
    hits = sum(item.cached for item in features.values())
    ctx.log(f"feature cache: {hits} of {len(features)} (representation, layer) features reused ({store.root})")
    for problem in store.stats.problems:  # this process's lookups
        ctx.warn(f"feature cache entry {problem}: removed and computed again")
    if ctx.rank == 0:
        ctx.metric("feature_cache_hits", hits, total=len(features))
    return features


def _check_split(split: Split, source: LayerSource) -> None:
    for name, part in zip(("train", "val", "test"), split.parts()):
        if len(part) == 0:
            raise UserError(
                f"ablation: {source.samples} samples leave the {name} split empty; use more samples "
                "or larger val_fraction / test_fraction"
            )


def _probe_settings(cfg: AblationSection, seed: int, device: torch.device, ctx: JobContext) -> ProbeSettings:
    precision = "fp32"
    if cfg.use_amp and device.type == "cuda":
        precision = cfg.amp_dtype
        if not amp_dtype_supported(device, precision):
            ctx.warn("this GPU has no bf16: probes use fp16 autocast instead")
            precision = "fp16"
    return ProbeSettings(
        hidden_dim=cfg.hidden_dim,
        dropout=cfg.dropout,
        weight_decay=cfg.weight_decay,
        learning_rate=cfg.learning_rate,
        batch_size=cfg.batch_size,
        max_epochs=cfg.max_epochs,
        patience=cfg.patience,
        num_runs=QUICK_RUNS if cfg.quick else cfg.num_runs,
        precision=precision,
        seed=seed,
    )


def _probe_pending(
    tasks: list[ProbeTask],
    features: dict[tuple[str, str], LayerFeatures],
    source: LayerSource,
    split: Split,
    settings: ProbeSettings,
    device: torch.device,
    ctx: JobContext,
) -> int:
    """Train this process's share of the probes that have no shard yet, a shard per probe; returns how many.
    The shares are balanced by the probes' widths (rank 0's progress also counts the probes done before)."""

    def width(task: ProbeTask) -> int:
        return sum(_array(features, task.base, layer).shape[1] for layer in task.inputs)

    pending = ctx.dist.broadcast([i for i, t in enumerate(tasks) if not ctx.shard_done(t.shard)])
    earlier = len(tasks) - len(pending)
    if earlier:
        ctx.log(f"resuming: {earlier} of {len(tasks)} probes already done")
    costs = [width(tasks[i]) + source.classes for i in pending]  # per sample and hidden unit of a probe
    own = [tasks[i] for i in mine(pending, costs, ctx.rank, ctx.world_size)]
    done = earlier if ctx.rank == 0 else 0
    total = done + len(own)
    ctx.reset_rate()
    ctx.progress(done, total, unit="probes", stage="probes")
    for group, resident in _groups(own, width, source.samples, settings, device):
        ctx.check_cancelled()
        arrays = [np.concatenate([_array(features, t.base, layer) for layer in t.inputs], axis=1) for t in group]
        table = FeatureTable(arrays, split.train, device, resident)
        del arrays
        names = ", ".join(dict.fromkeys(t.representation for t in group))
        label = f"{names}: {len(group)} probes x {settings.num_runs} seeds"

        def on_epoch(epoch: int, training: int, label: str = label, done: int = done) -> None:
            ctx.check_cancelled()
            ctx.progress(done, total, unit="probes", stage="probes", group=label, epoch=epoch, training=training)

        t0 = time.perf_counter()
        results = train_probes(table, source.labels, split, source.classes, settings, on_epoch)
        share = (time.perf_counter() - t0) / len(group)
        for task, members in zip(group, results):
            row = _row(task, members, table.width, features, share)
            ctx.save_shard(task.shard, lambda path, row=row: path.write_text(json.dumps(asdict(row))))
            done += 1
            ctx.progress(
                done, total, unit="probes", stage="probes", representation=task.representation, layer=task.layer
            )
            ctx.first_batch_done()  # where no features were extracted (all cached), start-up ends with a probe
            ctx.metric(
                "probe_test_acc",
                row.test_acc_mean,
                std=row.test_acc_std,
                val=row.val_acc_mean,
                val_std=row.val_acc_std,
                representation=task.representation,
                layer=task.layer,
                layer_index=task.layer_index,
            )
        del table
    return len(own)


def _array(features: dict[tuple[str, str], LayerFeatures], base: str, layer: str) -> np.ndarray:
    array = features[base, layer].array
    assert array is not None  # extract() fills every entry
    return array


def _groups(
    tasks: list[ProbeTask],
    width: Callable[[ProbeTask], int],
    samples: int,
    settings: ProbeSettings,
    device: torch.device,
) -> list[tuple[list[ProbeTask], bool]]:
    """Batches of probes of equal feature width that train together, and whether their features stay on the
    device. Bounded by memory for the features and by ACTIVATION_ELEMENTS for the ensemble's activations."""
    if device.type == "cuda":
        budget = int(torch.cuda.mem_get_info(device)[0] * DEVICE_SHARE)
    else:
        budget = HOST_GROUP_BYTES
    by_width: dict[int, list[ProbeTask]] = {}
    for task in tasks:
        by_width.setdefault(width(task), []).append(task)
    most = max(1, ACTIVATION_ELEMENTS // (settings.num_runs * settings.batch_size * settings.hidden_dim))
    groups = []
    for w, same in by_width.items():
        per_task = samples * w * 4
        size = max(1, min(most, budget // max(1, per_task)))
        for start in range(0, len(same), size):
            groups.append((same[start : start + size], per_task * min(size, len(same) - start) <= budget))
    return groups


def _row(
    task: ProbeTask,
    members: list[MemberResult],
    width: int,
    features: dict[tuple[str, str], LayerFeatures],
    probe_seconds: float,
) -> ResultRow:
    def stats(values: list[float]) -> tuple[float, float]:
        return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0

    used = [features[task.base, layer] for layer in task.inputs]
    train, val, test = (stats([getattr(m, f"{s}_acc") for m in members]) for s in ("train", "val", "test"))
    return ResultRow(
        representation=task.representation,
        layer=task.layer,
        layer_index=task.layer_index,
        feature_dim=width,
        train_acc_mean=train[0],
        train_acc_std=train[1],
        val_acc_mean=val[0],
        val_acc_std=val[1],
        test_acc_mean=test[0],
        test_acc_std=test[1],
        epochs_mean=statistics.fmean(m.epochs for m in members),
        feature_time_s=sum(item.seconds for item in used),
        probe_time_s=probe_seconds,
        cached=all(item.cached for item in used),
    )
