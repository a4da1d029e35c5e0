"""TracIn over all layers: the engine's factored projected gradients (method = factored) against exact all-parameter
TracIn, Captum's TracInCP on all parameters and dattri's TracIn and LoGra, and its training-gradient cache.

Setting: the BERT classifier, data and three checkpoints of tracin_bench.py (built from a config, trained here for
a few hundred steps on planted signal words, 5% of the training labels flipped); N training x M test examples
(--train, --test; BERT-small 4096 x 64, BERT-base 20480 x 64). --checkpoint-cache DIR reuses trained checkpoints.
The results file gives each checkpoint's accuracy on held-out examples and warns when the last one is near chance:
then every training gradient points nearly the same way, the scores of a test example differ by little more than
their sign, and rounding (bf16) or projection reorders them, so agreement says little about a trained model.

Rows (--modes takes a comma list; all by default):
- proj-K (one per K of --sizes): ours, every Linear, Embedding and LayerNorm parameter, each layer's gradient
  projected to K x K (output x input) token by token, bf16 autocast forward; proj-K-fp32 for the largest K
  with an fp32 forward (the precision dattri runs at; BERT-base: on the first 4096 training examples);
- last: ours, closed form on the last layers (pooler + classifier), bf16: the fast but less faithful mode;
- exact: ours, exact per-example gradients of every parameter (factored, unprojected, fp32) on the first
  n_exact training x m_exact test examples: the reference of the agreement columns;
- vmap-exact: the same reference by torch.func vmap (an independent computation), BERT-small and --quick only;
- captum-all: Captum TracInCP on all parameters with its default arguments (a backward pass per example), on
  a prefix of the training set: its rate is per example on that prefix (extrapolated to N, said on the row);
- dattri-logra-K: dattri's LoGraAttributor with hessian="Identity" (its projected gradient dot product, i.e.
  TracIn at one checkpoint), proj_dim = K*K (K x K per layer, like ours), on every Linear layer (its hooks take
  no Embedding or LayerNorm), one attributor per checkpoint, the scores summed with the learning rates;
- dattri-tracin: dattri's TracInAttributor on all parameters (vmap gradients, then a dense random projection of
  the whole gradient to --dattri-dim numbers), on the first n_exact training examples (a prefix: rate per
  example on it);
- cache: a second, different test set scored against the training gradients that a first run left in the cache
  (proj-K for each K of --cache-sizes), against recomputing them: the time ratio, and where the cached run's
  time goes (one run under torch.profiler: cache key, checkpoint loads, test gradients, reading the cached
  blocks, products).

Agreement (per test example across training examples, then the mean over test examples), against the exact row
on its n_exact x m_exact examples (the rows shared with a capped mode where it scored fewer): Spearman, and top-10
overlap (share of the 10 highest-scoring training examples both agree on). Flipped AUC: how well self-influence
ranks the flipped training labels above the clean ones (rows that compute self-influence). Rate: training
examples scored per second against all M test examples over the 3 checkpoints, loading them included: median of
3 timed runs after a warm-up run (1 for runs slower than 2 s). Peak: the largest GPU memory allocated in a run.

Usage on a GPU machine (each command within 10 minutes on an H100; the table prints each row's peak GPU memory):
    python benchmarks/tracin_projected_bench.py --quick --device cuda --out /tmp/tracin_projected_quick.md
    python benchmarks/tracin_projected_bench.py --model small --checkpoint-cache /tmp/tracin-ckpt \
        --out benchmarks/results/tracin_projected_small_H100.md
    python benchmarks/tracin_projected_bench.py --model base --checkpoint-cache /tmp/tracin-ckpt \
        --modes proj,proj-fp32,last,exact,captum-all,dattri-logra,cache \
        --out benchmarks/results/tracin_projected_base_H100.md
BERT-base trains its checkpoints first (9 epochs at a peak lr of 1e-4; kept in --checkpoint-cache for the next
command) and scores 20480 training examples in micro-batches of 256 (--micro-batch); its slower rows score a
prefix of the training set (proj-32-fp32 4096, dattri LoGra 1024, Captum 32 examples). dattri's TracIn on
BERT-base projects each example's 110M-number gradient densely and takes minutes per batch, so it is left out.
Quick check on a CPU (tiny model, under a minute):
    python benchmarks/tracin_projected_bench.py --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tracin_bench import (
    Outcome,
    Size,
    add_common_arguments,
    build,
    captum,
    checkpoint_accuracy,
    chosen_device,
    chosen_size,
    dataset,
    environment,
    fmt,
    measure,
    ours,
    positive,
    profile,
    report,
    timed,
)

from gpuopt_tui.jobs.data import TextDataset
from gpuopt_tui.jobs.models.base import Adapter, Checkpoint
from gpuopt_tui.jobs.tracin import TracInOptions, rank_correlation, select_parameters
from gpuopt_tui.jobs.tracin.agreement import top_k_overlap
from gpuopt_tui.jobs.tracin.job import flipped_auc

TOP_K = 10
HELD_OUT, HELD_OUT_SEED = 512, 5  # clean examples the checkpoints' accuracy is measured on
MIN_ACCURACY = 0.8  # below this at the last checkpoint the results file warns that the model is barely trained


@dataclass(frozen=True)
class Plan:
    """Sizes of one model's part: N, M, the exact subset, Captum's prefix, projection sizes."""

    n_train: int
    n_test: int
    n_exact: int  # training examples of the exact reference
    m_exact: int  # test examples of the exact reference
    n_captum: int
    n_logra: int  # training examples of dattri's LoGra (a prefix when fewer than n_train)
    n_fp32: int  # training examples of the proj-K-fp32 row (a prefix when fewer than n_train)
    n_dattri: int  # training examples of dattri's TracIn
    sizes: tuple[int, ...]  # K of the proj-K rows
    cache_sizes: tuple[int, ...]  # K of the cache comparisons
    dattri_dim: int  # dattri TracIn's dense projection
    loader_batch: int  # dattri's data loaders
    micro_batch: int | Literal["auto"] = "auto"  # our projected and last-layer rows (the exact one: auto)
    fp32_sizes: tuple[int, ...] = ()  # K of the proj-K-fp32 rows (none given: the largest of `sizes`)


PLANS = {
    "quick": Plan(96, 8, 32, 4, 16, 96, 96, 32, (4, 8), (8,), 64, 16),
    "small": Plan(4096, 64, 512, 16, 128, 4096, 4096, 512, (8, 16, 32, 64), (16, 32), 1024, 64),
    # dattri's TracIn projects each example's whole gradient with a fresh dense random matrix per batch: on
    # BERT-base (110M parameters) that is minutes per batch, so it gets one batch
    # the cache at 16 x 16 only: at 32 x 32 the 20480 gradients of BERT-base take 10 GB per run
    # micro-batches of 256 (about 8 GiB of activations): "auto" would fill most of the GPU, and the goal is a peak
    # of at most 16 GiB; the rows slower per example (fp32, Captum, dattri) score a prefix, so that the whole run
    # takes minutes
    "base": Plan(20480, 64, 256, 16, 32, 1024, 4096, 32, (16, 32), (16,), 1024, 32, 256),
}
MODES = ("proj", "proj-fp32", "last", "exact", "vmap-exact", "captum-all", "dattri-logra", "dattri-tracin", "cache")
GOAL_RATE, GOAL_SPEARMAN, GOAL_PEAK_GIB, GOAL_DATTRI, GOAL_CACHE = 10_000.0, 0.9, 16.0, 2.0, 20.0


@dataclass
class Row:
    key: str
    mode: str
    n_train: int
    settings: str = ""
    rate: float | None = None
    peak_gib: float | None = None
    spearman: float | None = None
    top_overlap: float | None = None
    flipped_auc: float | None = None
    note: str = ""
    skipped: str = ""
    error: str = ""
    outcome: Outcome | None = field(default=None, repr=False)


# --- the modes ---------------------------------------------------------------------------------------------------
def dattri_version() -> str | None:
    """dattri's version, or None when it cannot be imported (the dattri rows are then skipped)."""
    try:
        from importlib.metadata import version

        import dattri.algorithm  # noqa: F401  (pulls scipy, which dattri needs)

        return version("dattri")
    except Exception:
        return None


def _rows(ds: TextDataset) -> list[dict[str, Tensor]]:
    return [{k: ds.tensors[k][i] for k in ("input_ids", "attention_mask", "labels")} for i in range(len(ds))]


def dattri_logra(
    adapter: Adapter, checkpoints: list[Checkpoint], train: TextDataset, test: TextDataset, k: int, batch: int
) -> Callable[[], Outcome]:
    """dattri's LoGra, identity Hessian, one attributor per checkpoint, scores summed with the learning rates."""
    from dattri.algorithm.logra import LoGraAttributor
    from dattri.task import AttributionTask
    from torch.utils.data import DataLoader

    model, device = adapter.model, adapter.device
    layers = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]  # its hooks take no other layer

    def loss(model: nn.Module, data: dict[str, Tensor], device: str) -> Tensor:
        # mean over the batch: LoGra's compressor multiplies each per-example gradient by the batch size
        logits = model(input_ids=data["input_ids"].to(device), attention_mask=data["attention_mask"].to(device)).logits
        return F.cross_entropy(logits.float(), data["labels"].to(device))

    def load(model: nn.Module, path: str) -> nn.Module:
        adapter.load_weights(Path(path))
        return model

    def run() -> Outcome:
        total: Tensor | None = None
        for ckpt in checkpoints:
            task = AttributionTask(loss_func=loss, model=model, checkpoints=str(ckpt.path), checkpoints_load_func=load)
            attributor = LoGraAttributor(
                task, layer_names=layers, hessian="Identity", device=str(device), proj_dim=k * k, offload="none"
            )
            train_loader = DataLoader(_rows(train), batch_size=batch, shuffle=False)
            attributor.cache(train_loader)
            scores = attributor.attribute(train_loader, DataLoader(_rows(test), batch_size=batch, shuffle=False))
            total = ckpt.lr * scores if total is None else total + ckpt.lr * scores
        assert total is not None
        settings = f"proj_dim {k * k} ({k} x {k} per layer), {len(layers)} Linear layers with their biases, fp32"
        return Outcome(total.T.float().cpu(), None, settings)

    return run


def dattri_tracin(
    adapter: Adapter, checkpoints: list[Checkpoint], train: TextDataset, test: TextDataset, dim: int, batch: int
) -> Callable[[], Outcome]:
    """dattri's TracInAttributor on all parameters, the gradients projected densely to `dim` numbers."""
    from dattri.algorithm.tracin import TracInAttributor
    from dattri.task import AttributionTask
    from torch.utils.data import DataLoader, TensorDataset

    model, device = adapter.model, adapter.device

    def loss(params: dict[str, Tensor], data: tuple[Tensor, ...]) -> Tensor:
        ids, mask, label = data
        return adapter.functional_loss(
            params, {"input_ids": ids[None], "attention_mask": mask[None], "labels": label[None]}
        )[0]

    def load(model: nn.Module, path: str) -> nn.Module:
        adapter.load_weights(Path(path))
        return model

    def loader(ds: TextDataset) -> DataLoader:
        tensors = (ds.tensors[k].to(device) for k in ("input_ids", "attention_mask", "labels"))
        return DataLoader(TensorDataset(*tensors), batch_size=batch, shuffle=False)

    def run() -> Outcome:
        task = AttributionTask(
            loss_func=loss, model=model, checkpoints=[str(c.path) for c in checkpoints], checkpoints_load_func=load
        )
        projector = {"proj_dim": dim, "proj_max_batch_size": 32, "proj_seed": 0, "device": str(device)}
        weights = torch.tensor([c.lr for c in checkpoints])
        attributor = TracInAttributor(
            task, weights, normalized_grad=False, projector_kwargs=projector, device=str(device)
        )
        scores = attributor.attribute(loader(train), loader(test))
        return Outcome(scores.T.float().cpu(), None, f"dense projection to {dim}, fp32, batches of {batch}")

    return run


# --- the benchmark ---------------------------------------------------------------------------------------------------
def run(
    size_name: str, size: Size, plan: Plan, device: torch.device, modes: list[str], cache_dir: Path | None
) -> tuple[list[Row], dict[str, Any]]:
    gpu = device.type == "cuda"
    low = "bf16" if gpu else "fp32"
    size = dataclasses.replace(size, n_train=plan.n_train, n_test=plan.n_test)
    with tempfile.TemporaryDirectory() as tmp:
        adapter, checkpoints, train, test, training = build(size, device, Path(tmp), cache_dir)
        flipped = set(train.meta["flipped"])
        probe = {k: v[:1].to(device) for k, v in test.tensors.items()}
        everything = select_parameters(adapter, probe, "all")
        last = select_parameters(adapter, probe, "last", 2)
        sub_train, sub_test = train.head(plan.n_exact), test.head(plan.m_exact)
        dattri = dattri_version()
        facts: dict[str, Any] = {"training": training, "flipped": len(flipped), "dattri": dattri}
        held_out = dataset(size, HELD_OUT, HELD_OUT_SEED, adapter, 0.0)
        facts["accuracy"] = checkpoint_accuracy(adapter, checkpoints, held_out)

        def mode(key: str, title: str, fn: Callable[[], Outcome], n: int, note: str = "") -> tuple[Row, Any]:
            return Row(key, title, n, note=note), fn

        def prefix(n: int) -> str:
            return f"the first {n} of the {len(train)} training examples; rate per example on them"

        def factored(k: int, precision: str) -> TracInOptions:
            return TracInOptions(
                method="factored", precision=precision, projection_in=k, projection_out=k, batch_size=plan.micro_batch
            )

        table: list[tuple[Row, Any]] = []
        if "proj" in modes:
            for k in plan.sizes:
                fn = ours(adapter, checkpoints, train, test, everything, factored(k, low))
                table.append(mode(f"proj-{k}", f"ours: all layers, factored {k} x {k}, {low}", fn, len(train)))
        if "proj-fp32" in modes and low != "fp32":
            rows = train.head(plan.n_fp32)
            note = prefix(len(rows)) if len(rows) < len(train) else ""
            for k in plan.fp32_sizes or (max(plan.sizes),):
                fn = ours(adapter, checkpoints, rows, test, everything, factored(k, "fp32"))
                table.append(mode(f"proj-{k}-fp32", f"ours: all layers, factored {k} x {k}, fp32", fn, len(rows), note))
        if "last" in modes:
            fn = ours(
                adapter, checkpoints, train, test, last, TracInOptions(precision=low, batch_size=plan.micro_batch)
            )
            table.append(mode("last", f"ours: last layers, closed form, {low}", fn, len(train)))
        if "exact" in modes or any(m in modes for m in ("proj", "last", "dattri-logra")):
            exact = dataclasses.replace(factored(0, "fp32"), batch_size="auto")
            fn = ours(adapter, checkpoints, sub_train, sub_test, everything, exact)
            note = f"reference: {len(sub_train)} training x {len(sub_test)} test examples"
            table.append(mode("exact", "ours: all parameters, exact, fp32", fn, len(sub_train), note))
        if "vmap-exact" in modes and size_name != "base":
            fn = ours(adapter, checkpoints, sub_train, sub_test, everything, TracInOptions(method="vmap"))
            table.append(mode("vmap-exact", "ours: all parameters, exact by vmap, fp32", fn, len(sub_train), ""))
        if "captum-all" in modes:
            rows = train.head(plan.n_captum)
            fn = captum("default", adapter, checkpoints, rows, test, None)
            table.append(
                mode("captum-all", "Captum TracInCP, default, all parameters", fn, len(rows), prefix(len(rows)))
            )
        dattri_modes: list[tuple[Row, Any]] = []
        logra_rows, dattri_rows = train.head(plan.n_logra), train.head(plan.n_dattri)
        if "dattri-tracin" in modes:
            title = f"dattri {dattri or ''} TracIn, all parameters".replace("  ", " ")
            dattri_modes.append(
                mode(
                    "dattri-tracin",
                    title,
                    lambda: dattri_tracin(adapter, checkpoints, dattri_rows, test, plan.dattri_dim, plan.loader_batch),
                    len(dattri_rows),
                    prefix(len(dattri_rows)),
                )
            )
        if "dattri-logra" in modes:
            k = plan.sizes[len(plan.sizes) // 2]
            title = f"dattri {dattri or ''} LoGra, identity Hessian, {k} x {k}".replace("  ", " ")
            dattri_modes.append(
                mode(
                    f"dattri-logra-{k}",
                    title,
                    lambda k=k: dattri_logra(adapter, checkpoints, logra_rows, test, k, plan.loader_batch),
                    len(logra_rows),
                    prefix(len(logra_rows)) if len(logra_rows) < len(train) else "",
                )
            )
        for row, make in dattri_modes:
            if dattri is None:
                row.skipped = (
                    "dattri cannot be imported here (pip install dattri==0.3.0 --no-deps; it needs scipy, pyyaml, tqdm)"
                )
            else:
                try:
                    table.append((row, make()))
                    continue
                except Exception as exc:
                    row.error = f"{type(exc).__name__}: {str(exc)[:200]}"
            table.append((row, None))
        for row, fn in table:
            if fn is None:
                continue
            print(f"... {row.key}: {row.mode}, {row.n_train} training examples", flush=True)
            began = time.perf_counter()
            try:
                row.outcome, seconds, row.peak_gib = measure(device, fn)
                row.settings = row.outcome.settings
                row.rate = row.n_train / seconds
            except Exception as exc:  # a failed mode (e.g. out of memory) is reported, the others still run
                row.error = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(f"    {time.perf_counter() - began:.1f} s", flush=True)
        rows = [row for row, _ in table]
        compare(rows, flipped)
        if "cache" in modes:
            second = dataset(size, plan.n_test, 4, adapter, 0.0)
            facts["cache"] = []
            for k in plan.cache_sizes:
                print(f"... cache: factored {k} x {k}, a second test set against cached training gradients", flush=True)
                facts["cache"].append(
                    cache_ratio(device, adapter, checkpoints, train, test, second, everything, factored(k, low))
                )
    return rows, facts


def compare(rows: list[Row], flipped: set[int]) -> None:
    """Spearman and top-10 overlap against the exact row on the examples both scored; flipped AUC."""
    exact = next((r.outcome for r in rows if r.key == "exact" and r.outcome is not None), None)
    for row in rows:
        out = row.outcome
        if out is None:
            continue
        if exact is not None:
            m, n = min(out.scores.shape[0], exact.scores.shape[0]), min(out.scores.shape[1], exact.scores.shape[1])
            ours_part, ref = out.scores[:m, :n], exact.scores[:m, :n]
            row.spearman = rank_correlation(ours_part, ref)
            row.top_overlap = top_k_overlap(ours_part, ref, TOP_K)
        if out.self_influence is not None:
            row.flipped_auc = flipped_auc(out.self_influence, torch.arange(len(out.self_influence)), flipped)


def cache_ratio(
    device: torch.device,
    adapter: Adapter,
    checkpoints: list[Checkpoint],
    train: TextDataset,
    test: TextDataset,
    second: TextDataset,
    names: list[str],
    options: TracInOptions,
) -> dict[str, Any]:
    """Time of a second test set against the cached training gradients vs recomputing them, and the cached run's
    stages under torch.profiler."""
    with tempfile.TemporaryDirectory() as folder:
        cached = dataclasses.replace(options, train_cache=Path(folder))
        _, fill, fill_peak = timed(device, ours(adapter, checkpoints, train, test, names, cached))
        read_out, read, read_peak = measure(device, ours(adapter, checkpoints, train, second, names, cached))
        stages = profile(device, ours(adapter, checkpoints, train, second, names, cached))
        size = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
    fresh_out, fresh, fresh_peak = measure(device, ours(adapter, checkpoints, train, second, names, options))
    return {
        "settings": f"factored {options.projection_out} x {options.projection_in}, {options.precision}",
        "fill_seconds": fill,
        "cached_seconds": read,
        "recompute_seconds": fresh,
        "ratio": fresh / read,
        "cache_bytes": size,
        "peak_gib": [fill_peak, read_peak, fresh_peak],
        "spearman_cached_vs_recomputed": rank_correlation(read_out.scores, fresh_out.scores),
        "profile": stages,
    }


# --- reporting ---------------------------------------------------------------------------------------------------------
def markdown(
    env: dict[str, Any], size_name: str, size: Size, plan: Plan, rows: list[Row], facts: dict[str, Any]
) -> str:
    training = facts["training"]
    how = (
        f"reused from {training['reused_from']}"
        if training["reused_from"]
        else f"trained here in {training['seconds']:.1f} s"
    )
    lines = [
        "# TracIn over all layers: factored projected gradients",
        "",
        f"- date: {env['date']}",
        f"- device: {env['device']} (CUDA {env['cuda']})",
        f"- versions: python {env['python']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"captum {env['captum']}, dattri {facts['dattri'] or 'not installed'}",
        f"- command: `{env['command']}`",
        f"- model: BERT ({size_name}) hidden {size.hidden}, {size.layers} layers, vocab {size.vocab}, seq {size.seq}; "
        f"checkpoints {how} ({size.train_epochs} epochs on the first {facts['training']['fit']} training examples, "
        f"AdamW peak lr {size.train_lr:g}); held-out accuracy at the 3 checkpoints ({HELD_OUT} clean examples): "
        f"{', '.join(f'{a:.3f}' for a in facts['accuracy'])}; {facts['flipped']} of the {plan.n_train} training "
        "labels flipped",
        *barely_trained(facts["accuracy"]),
        f"- scored: N = {plan.n_train} training x M = {plan.n_test} test examples, 3 checkpoints; exact reference on "
        f"{plan.n_exact} x {plan.m_exact}; the whole benchmark took {facts['wall_seconds']:.0f} s",
        "- rate: training examples per second against all M test examples over the 3 checkpoints (median of 3 "
        "timed runs after a warm-up; 1 for runs over 2 s); rows on a prefix of the training set say so, and their "
        "rate is per example on that prefix (extrapolated to N)",
        f"- Spearman, top-{TOP_K}: against exact all-parameter TracIn (row `exact`), per test example, mean over "
        "test examples, on the examples both scored",
        "- flipped AUC: probability that self-influence ranks a flipped training label above a clean one",
        "",
        f"| mode | settings | train N | train ex/s | peak GiB | Spearman vs exact | top-{TOP_K} overlap | flipped AUC |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rate = f"skipped: {r.skipped}" if r.skipped else f"failed: {r.error}" if r.error else fmt(r.rate, ",.0f")
        note = f" ({r.note})" if r.note else ""
        lines.append(
            f"| {r.mode}{note} | {r.settings} | {r.n_train} | {rate} | {fmt(r.peak_gib, '.2f')} | "
            f"{fmt(r.spearman, '.4f')} | {fmt(r.top_overlap, '.3f')} | {fmt(r.flipped_auc, '.3f')} |"
        )
    caches = facts.get("cache") or []
    for cache in caches:
        lines += cache_markdown(plan, cache)
    lines += ["", "## Goals", "", *goals(size_name, rows, caches)]
    return "\n".join(lines) + "\n"


def barely_trained(accuracy: list[float]) -> list[str]:
    """A warning line when the last checkpoint is near chance: then every training gradient points nearly the
    same way, scores differ by little more than their sign, and the agreement columns say little about a
    trained model (any rounding reorders them)."""
    if accuracy[-1] >= MIN_ACCURACY:
        return []
    return [
        f"- WARNING: the last checkpoint's held-out accuracy {accuracy[-1]:.3f} is below {MIN_ACCURACY}: the model is "
        "barely trained, its training gradients nearly parallel; the agreement columns do not describe a trained model"
    ]


def cache_markdown(plan: Plan, cache: dict[str, Any]) -> list[str]:
    peaks = ", ".join(fmt(p, ".2f") for p in cache["peak_gib"]) if cache["peak_gib"][0] is not None else ""
    prof = cache["profile"]
    stages = prof["stages"]
    lines = [
        "",
        f"### Second test set against the cached training gradients: {cache['settings']}",
        "",
        f"{plan.n_test} other test examples against the training gradients a first run left in the cache "
        f"({cache['cache_bytes'] / 2**20:.1f} MiB): {cache['cached_seconds']:.3f} s vs {cache['recompute_seconds']:.3f} s "
        f"recomputing = {cache['ratio']:.1f}x (filling the cache: {cache['fill_seconds']:.3f} s"
        + (f"; peak GiB filling, cached, recomputing: {peaks}" if peaks else "")
        + "); Spearman cached vs recomputed (bf16-stored gradients): "
        f"{cache['spearman_cached_vs_recomputed']:.4f}.",
        "",
        f"Where the cached run's time goes (one run under torch.profiler, {prof['wall_ms']:.1f} ms wall; host ms: "
        "inside the stage on the host, waits for the GPU included; GPU ms: kernels and copies it launched; the "
        "cached blocks are read from disk in a background thread, so `tracin.cache_blocks` is the wait for them "
        "plus their copy to the device):",
        "",
        "| stage | calls | host ms | GPU ms |",
        "|---|---:|---:|---:|",
    ]
    for name, stage in sorted(stages.items(), key=lambda item: -item[1]["host_ms"]):
        lines.append(f"| {name} | {stage['calls']} | {stage['host_ms']:.1f} | {stage['gpu_ms']:.1f} |")
    return lines


def goals(size_name: str, rows: list[Row], caches: list[dict[str, Any]]) -> list[str]:
    ours_rows = [r for r in rows if r.key.startswith("proj-") and r.rate]
    out = []
    if size_name == "small":
        met = [r for r in ours_rows if r.rate >= GOAL_RATE and (r.spearman or 0) >= GOAL_SPEARMAN]
        best = ", ".join(f"{r.key} {r.rate:,.0f} ex/s at Spearman {fmt(r.spearman, '.3f')}" for r in ours_rows)
        out.append(
            f"- >= {GOAL_RATE:,.0f} train ex/s with Spearman >= {GOAL_SPEARMAN} (BERT-small): "
            f"{'met by ' + ', '.join(r.key for r in met) if met else 'not met'} ({best or 'no row ran'})"
        )
    if size_name == "base":
        peaks = ", ".join(f"{r.key} {fmt(r.peak_gib, '.2f')} GiB" for r in ours_rows)
        met = ours_rows and all(r.peak_gib is not None and r.peak_gib <= GOAL_PEAK_GIB for r in ours_rows)
        out.append(
            f"- peak <= {GOAL_PEAK_GIB:g} GiB (BERT-base): {'met' if met else 'not met or not measured'} ({peaks})"
        )
    rivals = [r for r in rows if r.key.startswith("dattri") and r.rate]
    if rivals:
        fastest = max(rivals, key=lambda r: r.rate or 0.0)
        fair = [r for r in ours_rows if (r.spearman or 0) >= (fastest.spearman or 0)]
        if fair:
            best = max(fair, key=lambda r: r.rate or 0.0)
            ratio = (best.rate or 0) / (fastest.rate or 1)
            verdict = "met" if ratio >= GOAL_DATTRI else "not met"
            out.append(
                f"- >= {GOAL_DATTRI:g}x the fastest dattri row at equal or better agreement: {verdict}: {best.key} "
                f"{ratio:.1f}x {fastest.key} (Spearman {fmt(best.spearman, '.3f')} vs {fmt(fastest.spearman, '.3f')})"
            )
        else:
            out.append(
                f"- >= {GOAL_DATTRI:g}x dattri at equal or better agreement: no row of ours agrees as well as {fastest.key}"
            )
    else:
        out.append(f"- >= {GOAL_DATTRI:g}x dattri: not measured (no dattri row ran)")
    if caches:
        verdict = "met" if any(c["ratio"] >= GOAL_CACHE for c in caches) else "not met"
        ratios = ", ".join(f"{c['settings']} {c['ratio']:.1f}x" for c in caches)
        out.append(f"- second test set against cached gradients >= {GOAL_CACHE:g}x faster: {verdict} ({ratios})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser, "(default: 4096 small, 20480 base)", "(default 64)")
    parser.add_argument("--sizes", help="comma list of K for the proj-K rows (default: 8,16,32,64 small; 16,32 base)")
    parser.add_argument("--fp32-sizes", help="comma list of K for the proj-K-fp32 rows (default: the largest --sizes)")
    parser.add_argument(
        "--cache-sizes", help="comma list of K for the cache comparison (default: 16,32 small; 16 base)"
    )
    parser.add_argument(
        "--exact-train", type=positive, help="training examples of the exact reference (default 512 small)"
    )
    parser.add_argument(
        "--micro-batch",
        type=micro_batch,
        help="examples per micro-batch of our projected rows: auto or a number (default: auto; 256 for base)",
    )
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)} (default: all)")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := [m for m in modes if m not in MODES]:
        parser.error(f"unknown modes {', '.join(unknown)}; choose from {', '.join(MODES)}")
    size_name, size = chosen_size(args)
    plan = PLANS[size_name]
    sizes = tuple(int(k) for k in args.sizes.split(",")) if args.sizes else plan.sizes
    cache_sizes = tuple(int(k) for k in args.cache_sizes.split(",")) if args.cache_sizes else plan.cache_sizes
    plan = dataclasses.replace(
        plan,
        n_train=args.train or plan.n_train,
        n_test=args.test or plan.n_test,
        sizes=sizes,
        cache_sizes=cache_sizes,
        fp32_sizes=tuple(int(k) for k in args.fp32_sizes.split(",")) if args.fp32_sizes else plan.fp32_sizes,
        micro_batch=args.micro_batch or plan.micro_batch,
        n_exact=args.exact_train or plan.n_exact,
    )
    device = chosen_device(args)
    env = environment(device)
    start = time.perf_counter()
    rows, facts = run(size_name, size, plan, device, modes, args.checkpoint_cache)
    facts["wall_seconds"] = time.perf_counter() - start
    text = markdown(env, size_name, size, plan, rows, facts)
    plan_record = {"name": size_name, **asdict(plan)}
    record = {"environment": env, "plan": plan_record, "size": asdict(size), "modes": modes, "facts": facts}
    return report(args.out, text, record, rows)


def micro_batch(text: str) -> int | Literal["auto"]:
    return "auto" if text == "auto" else positive(text)


if __name__ == "__main__":
    raise SystemExit(main())
