"""The attribution run: Integrated Gradients over a dataset, in resumable shards, with result files.

Samples are ordered by length (when `length_bucketing` is on) and cut into batches; each batch is trimmed to
its longest real length, attributed, and saved as a shard in the run's state directory. A resumed run skips
the batches whose shard exists. At the end the shards are gathered into the result files (see outputs.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from gpuopt_tui.core.atomic import write_json
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.attribution import AttributionProfile
from gpuopt_tui.core.results.attribution import write_samples
from gpuopt_tui.core.results.attribution_summary import CHECK_NAME
from gpuopt_tui.jobs import short_attention
from gpuopt_tui.jobs.attribution.adaptive import batch_size_note, tolerance_warning
from gpuopt_tui.jobs.attribution.audit import audit, audit_count, audit_warning, chosen_samples
from gpuopt_tui.jobs.attribution.check import compare_paths
from gpuopt_tui.jobs.attribution.compiled import StepCompiler
from gpuopt_tui.jobs.attribution.completions import CompletionRun, prepare_completions
from gpuopt_tui.jobs.attribution.deltas import relative_deltas
from gpuopt_tui.jobs.attribution.engine import RESULT_KEYS, Settings, attribute_batch, step_compiler
from gpuopt_tui.jobs.attribution.outputs import Collected, write_tensors
from gpuopt_tui.jobs.attribution.panels import step_counts
from gpuopt_tui.jobs.attribution.precision import REDUCED, NonFiniteGradients
from gpuopt_tui.jobs.attribution.report import FILE_NAMES, Report, Results, build_report
from gpuopt_tui.jobs.attribution.start_precision import StartPrecision
from gpuopt_tui.jobs.completion_data import SAMPLE_OF_ROW
from gpuopt_tui.jobs.context import PREPARE_STAGE, WRITE_STAGE, JobContext, ResumePart
from gpuopt_tui.jobs.data import TextDataset, cut_texts_note, length_sorted_order, load_dataset, trim_batch
from gpuopt_tui.jobs.device import amp_dtype_supported, free_memory, is_oom, resolve_device
from gpuopt_tui.jobs.digests import input_parts
from gpuopt_tui.jobs.models import Adapter, Batch, load_adapter, select_rows, to_device
from gpuopt_tui.jobs.sharding import mine

RESULT_SETTINGS = (
    "n_steps",
    "method",
    "precision",
    "cast_weights",
    "target",
    "baseline",
    "baseline_token",
    "optimized",
)
COMPILE_STAGE = "compiling the step forward (torch.compile)"


def run_job(profile: AttributionProfile, ctx: JobContext) -> dict[str, Any]:
    section = profile.attribution
    device = resolve_device(profile.run.device)
    adapter = load_adapter(profile.model, device, ctx.cache_dir, ctx.stage)
    ds = load_dataset(profile.data, adapter, stage=ctx.stage).head(section.n_samples)
    completions = prepare_completions(adapter, ds, profile.data, section, ctx.stage)  # causal LMs only
    if completions is not None:
        ds = completions.rows
    if note := cut_texts_note(ds, profile.data, adapter):
        ctx.log(note)
    ctx.stage(PREPARE_STAGE)
    settings = Settings.resolve(section, adapter, device, len(ds))
    ig = settings.ig
    plan = plan_batches(ds, section.batch_size, section.length_bucketing)
    _check_plan(ctx, settings, plan, input_parts(profile.model, adapter, [ds], ctx.cache_dir))
    with adapter.logits_only() as lean:  # only asks whether the model qualifies
        pass
    ctx.log(
        f"{adapter.describe()}; {_describe_rows(ds, completions)} in {len(plan)} batches; {_describe_steps(settings)} "
        f"({ig.method}, {_describe_mode(settings, lean, device)})"
    )
    fallback = ig.full_precision_fallback
    if ig.n_steps == "auto" and (warning := tolerance_warning(ig.tolerance, ig.precision, fallback)):
        ctx.warn(warning)
    if ig.n_steps == "auto" and (note := batch_size_note(section.batch_size, len(ds), device.type)):
        ctx.log(note)
    compiler = step_compiler(settings, ctx.event, lambda: ctx.stage(COMPILE_STAGE))
    start = time.perf_counter()
    chooser = settings.start_precision(device)
    attributed = _attribute_pending(ctx, adapter, ds, settings, plan, compiler, chooser)
    if compiler is not None and compiler.error is not None:
        ctx.warn(f"torch.compile failed, the steps ran without it: {compiler.error}")
    counts = ctx.dist.gather(attributed)  # returns once every rank's shards are written
    if counts is None:  # ranks other than 0 are done: rank 0 merges
        return {"samples": attributed}
    stage: dict[str, Any] = {"samples": sum(counts), "seconds": time.perf_counter() - start}
    collected, seconds = _gather(ctx, ds, len(plan), ig.n_steps == "auto")
    audited = _audit(ctx, adapter, ds, collected, settings, audit_count(section.audit_samples, device))
    if chooser is not None and chooser.ratio is not None:  # rank 0's choice (each rank measures its own)
        stage["start_precision"] = chooser.record()
    if completions is not None:  # from here on a sample is a prompt, whatever rows were attributed
        ds, collected = completions.samples, completions.per_sample(collected)
    results = Results(section, settings, seconds, compiler, stage, audited, completions)
    summary = _write_results(ctx, build_report(adapter, ds, collected, results, ctx.world_size), collected)
    if section.check_samples > 0:
        check = compare_paths(adapter, ds, settings, section.check_samples, ctx.cancellable_stage)
        write_json(ctx.results_dir / CHECK_NAME, check)
        ctx.artifact(ctx.results_dir / CHECK_NAME, "optimized vs original: relative difference of the scores")
        ctx.metric("check_max_rel_diff", check["max_rel_diff"])
        summary["check_max_rel_diff"] = check["max_rel_diff"]
    ctx.repeat_progress("attribution")  # run lists show the samples, not the later stages' counts
    return summary


def _audit(
    ctx: JobContext, adapter: Adapter, ds: TextDataset, collected: Collected, settings: Settings, count: int
) -> dict[str, Any] | None:
    """The audit of `count` samples (audit.py), or None when it is off."""
    if count <= 0:
        return None
    indices = chosen_samples(len(ds), count)
    ctx.log(f"audit: samples {', '.join(map(str, indices))} against a strict fp32 reference")
    scores, target, within = collected.token_scores, collected.target, collected.within
    result = audit(adapter, ds, indices, scores, target, within, settings, ctx.cancellable_stage)
    if warning := audit_warning(result):
        ctx.warn(warning)
    return result


def _describe_rows(ds: TextDataset, completions: CompletionRun | None) -> str:
    """What the batches hold: samples, or a causal LM's prompts as one row per completion token."""
    if completions is None or not completions.per_token:
        return f"{len(ds)} samples"
    return f"{len(completions.samples)} prompts as {len(ds)} rows (one per completion token)"


def _describe_steps(settings: Settings) -> str:
    ig = settings.ig
    if ig.n_steps != "auto":
        return f"{ig.n_steps} steps"
    counts = step_counts(ig.max_steps)
    return (
        f"steps until the relative convergence delta and the token scores' error estimate are within "
        f"{ig.tolerance:g} (adaptive panels: {', '.join(map(str, counts[:3]))}, ... up to {counts[-1]} steps)"
    )


def _describe_mode(settings: Settings, lean: bool, device: torch.device) -> str:
    ig = settings.ig
    if not settings.optimized:
        return f"{ig.precision}, one sample and one step at a time"
    weights = f"{ig.precision} weights" if ig.cast_weights else ig.precision
    fused = lean and short_attention.applies_to(device, REDUCED.get(ig.precision))
    return (
        f"{weights}, batched"
        + (", last layer for the first token only (exact)" if lean else "")
        + (f", fused attention kernels up to {short_attention.MAX_SEQ} tokens" if fused else "")
        + (", compiled" if settings.compile else "")
    )


def plan_batches(ds: TextDataset, batch_size: int, bucketing: bool) -> list[list[int]]:
    """Sample indices of each batch: longest first when bucketing, else dataset order."""
    order = length_sorted_order(ds) if bucketing else list(range(len(ds)))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def shard_name(j: int) -> str:
    return f"batch_{j:05d}.safetensors"


def _check_plan(ctx: JobContext, settings: Settings, plan: list[list[int]], inputs: dict[str, ResumePart]) -> None:
    """Shards of an earlier attempt are reused only if they were made from the same data, model and tokenizer
    (`inputs`), with the same batches and the same settings that shape the results (chunk sizes, memory
    fraction and compilation may change on resume)."""
    record = settings.record()
    settings_record = {k: record[k] for k in RESULT_SETTINGS}
    if settings.ig.n_steps == "auto":
        settings_record |= {k: record[k] for k in ("tolerance", "max_steps", "full_precision_fallback")}
    ctx.check_resume_record(
        {
            **inputs,
            "settings": ResumePart(settings_record, "the settings"),
            "batches": ResumePart(plan, "the batches", "attribution.batch_size, length_bucketing, n_samples"),
            "values": ResumePart(list(RESULT_KEYS), "the values a shard holds", "another version of gpuopt-tui"),
        }
    )


def _attribute_pending(
    ctx: JobContext,
    adapter: Adapter,
    ds: TextDataset,
    settings: Settings,
    plan: list[list[int]],
    compiler: StepCompiler | None,
    chooser: StartPrecision | None,
) -> int:
    """Attribute this rank's batches of the plan that have no shard yet, one shard per finished batch;
    returns the number of samples attributed. `chooser` picks the precision each batch starts in (logged as it
    changes). The pending batches go to the ranks balanced by their tokens
    (rank 0's count also holds the samples done before, so the ranks' counts add up to the dataset)."""
    planner = settings.planner(ctx.event)
    pending = ctx.dist.broadcast([j for j in range(len(plan)) if not ctx.shard_done(shard_name(j))])
    earlier = len(ds) - sum(len(plan[j]) for j in pending)
    if earlier and ctx.rank == 0:
        ctx.log(f"resuming: {len(plan) - len(pending)} of {len(plan)} batches were already done")
    lengths = ds.tokens()
    costs = [len(plan[j]) * int(lengths[plan[j]].max()) for j in pending]
    pending = mine(pending, costs, ctx.rank, ctx.world_size)
    done = earlier if ctx.rank == 0 else 0
    total = done + sum(len(plan[j]) for j in pending)
    unit = "completion tokens" if SAMPLE_OF_ROW in ds.meta else "samples"  # per_target_token: a row per token
    ctx.reset_rate()
    ctx.progress(done, total, unit=unit, stage="attribution")

    def with_bf16_fallback(batch: Batch, on_chunk: Callable[[int, int], None]) -> dict[str, Tensor]:
        """IG of a batch; in bf16 again when fp16 overflowed (bf16 has fp32's range)."""
        try:
            return attribute_batch(adapter, batch, settings, planner, on_chunk, compiler, start=chooser)
        except NonFiniteGradients:
            if settings.ig.precision != "fp16" or not amp_dtype_supported(adapter.device, "bf16"):
                raise
        rows = batch["input_ids"].shape[0]
        ctx.event("fp16_overflow", rows=rows)
        ctx.warn(f"fp16 overflowed on a batch of {rows} samples: that batch was redone in bf16")
        bf16 = settings.with_ig(precision="bf16")
        return attribute_batch(adapter, batch, bf16, planner, on_chunk, compiler, start=chooser)

    def attribute(batch: Batch, offset: int) -> dict[str, Tensor]:
        """IG of a batch; when even one step does not fit in memory, its two halves one after the other."""
        rows = batch["input_ids"].shape[0]

        def on_chunk(part: int, parts: int) -> None:
            ctx.check_cancelled()
            ctx.progress(offset + rows * part // parts, total, unit=unit, stage="attribution")

        try:
            return with_bf16_fallback(batch, on_chunk)
        except Exception as exc:
            if not is_oom(exc):
                raise
            if rows == 1:
                raise UserError(
                    "out of GPU memory with one sample and one step: lower data.max_length or use a larger GPU"
                ) from exc
        free_memory(adapter.device)
        half = rows // 2
        ctx.event("oom_split", rows=rows, halves=[half, rows - half])
        first = attribute(select_rows(batch, slice(0, half)), offset)
        second = attribute(select_rows(batch, slice(half, None)), offset + half)
        return {k: torch.cat([first[k], second[k]]) for k in RESULT_KEYS}

    said = ""
    for j in pending:
        indices = plan[j]
        batch = to_device(trim_batch(ds.batch(indices), ds.token_fields), adapter.device)
        start = time.perf_counter()
        values = attribute(batch, done)
        ctx.first_batch_done()
        if chooser is not None and (line := chooser.describe()) != said:
            ctx.log(line)
            said = line
        values["index"] = torch.tensor(indices, dtype=torch.long)
        metadata = {"seconds": f"{time.perf_counter() - start:.6f}", "rank": str(ctx.rank)}
        ctx.save_shard(shard_name(j), _shard_writer(values, metadata))
        done += len(indices)
        ctx.progress(done, total, unit=unit, stage="attribution")
    return sum(len(plan[j]) for j in pending)


def _shard_writer(values: dict[str, Tensor], metadata: dict[str, str]) -> Callable[[Path], None]:
    return lambda path: save_file(values, str(path), metadata=metadata)


def _gather(ctx: JobContext, ds: TextDataset, n_batches: int, auto: bool) -> tuple[Collected, float]:
    """The shards as dataset-ordered tensors, and the compute seconds they took altogether (`auto`: the steps
    were "auto", so that the samples carry a verdict)."""
    ids = ds.tensors["input_ids"]
    token_scores = torch.zeros(ids.shape, dtype=torch.float32)
    values: dict[str, Tensor] = {}
    seconds = 0.0
    for j in range(n_batches):
        ctx.stage("collecting the batches", j, n_batches, "batches")
        with safe_open(str(ctx.shard_path(shard_name(j))), "pt") as f:
            seconds += float((f.metadata() or {}).get("seconds", 0.0))
            shard = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is no dict)
        index = shard.pop("index")
        scores = shard.pop("token_scores")
        token_scores[index, ..., : scores.shape[-1]] = scores
        for key, value in shard.items():
            values.setdefault(key, torch.zeros(len(ds), dtype=value.dtype))[index] = value
    collected = Collected(
        input_ids=ids,
        attention_mask=ds.tensors["attention_mask"],
        token_scores=token_scores,
        deltas=values["deltas"],
        relative_deltas=relative_deltas(values["deltas"], values["scores"], values["baseline_scores"]),
        scores=values["scores"],
        baseline_scores=values["baseline_scores"],
        target=values["target"],
        prediction=values["prediction"],
        probability=values["probability"],
        margin=values["margin"],
        low_margin=values["low_margin"],
        steps=values["steps"],
        fallback=values["fallback"],
        error=values["error"],
        within=values["within"] if auto else None,
        labels=ds.labels,
    )
    return collected, seconds


def _write_results(ctx: JobContext, report: Report, collected: Collected) -> dict[str, Any]:
    """The three result files and their events; returns the short summary for the run's `finished` event."""
    ctx.stage(WRITE_STAGE)
    files = {key: ctx.results_dir / name for key, name in FILE_NAMES.items()}
    if note := write_samples(files["jsonl"], report.records):
        ctx.warn(note)
    write_tensors(files["tensors"], collected, report.tensors)
    for kind, text in report.messages:
        (ctx.warn if kind == "warn" else ctx.log)(text)
    write_json(files["summary"], report.summary)
    ctx.artifact(files["jsonl"], "per-sample token attributions (one JSON line per sample)")
    ctx.artifact(files["tensors"], "padded score tensor, token ids, lengths and deltas (safetensors)")
    ctx.artifact(files["summary"], "top tokens, convergence deltas, settings and timing")
    ctx.metric("samples_per_s", report.summary["timing"]["samples_per_s"])
    ctx.metric("delta_median_rel", report.summary["deltas"]["median_rel"])
    ctx.metric("steps_mean", report.summary["steps"]["mean"])
    return report.outcome
