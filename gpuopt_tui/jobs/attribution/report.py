"""What an attribution run's result files say, computed from its collected results without writing anything."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import Tensor

from gpuopt_tui.core.profiles.attribution import AttributionSection
from gpuopt_tui.core.results.attribution import JSONL_NAME, TENSORS_NAME
from gpuopt_tui.core.results.attribution_summary import SUMMARY_NAME
from gpuopt_tui.jobs.attribution.adaptive import precision_chain
from gpuopt_tui.jobs.attribution.audit import audit_outcome
from gpuopt_tui.jobs.attribution.compiled import StepCompiler
from gpuopt_tui.jobs.attribution.completions import CompletionRun
from gpuopt_tui.jobs.attribution.deltas import delta_summary, steps_outcome, steps_summary
from gpuopt_tui.jobs.attribution.engine import Settings
from gpuopt_tui.jobs.attribution.outputs import Collected, sample_records, token_ranking
from gpuopt_tui.jobs.attribution.precision import RELATIVE_ERROR
from gpuopt_tui.jobs.data import TextDataset
from gpuopt_tui.jobs.models import Adapter

RANKING = "mean share of the sample's total |attribution| per occurrence (structure tokens and zeros excluded)"
FILE_NAMES = {"jsonl": JSONL_NAME, "tensors": TENSORS_NAME, "summary": SUMMARY_NAME}


@dataclass(frozen=True)
class Results:
    """What the result files say besides the samples' results."""

    section: AttributionSection
    settings: Settings
    seconds: float  # the compute seconds of all shards
    compiler: StepCompiler | None
    # the samples attributed by this attempt (all ranks), its wall seconds for them and, where the attempt chose
    # it, the precision its batches started in (start_precision.py)
    stage: dict[str, Any]
    audited: dict[str, Any] | None  # the audit's result (audit.py), None when it was off
    completions: CompletionRun | None  # a causal LM run's completions


@dataclass(frozen=True)
class Report:
    """The contents of a run's result files and what the run tells about them."""

    records: Iterable[dict[str, Any]]  # the lines of attributions.jsonl, built as they are read (once)
    summary: dict[str, Any]  # summary.json
    outcome: dict[str, Any]  # the short summary of the run's `finished` event
    tensors: dict[str, Tensor]  # attributions.safetensors' tensors besides the collected results' (a causal LM's)
    # the run's log lines and warnings about its results, in order
    messages: list[tuple[Literal["log", "warn"], str]] = field(default_factory=list)


def low_margin_summary(collected: Collected, precision: str) -> dict[str, Any]:
    """How many samples have a top-two margin of F(x) within the steps' precision error, and that error."""
    return {
        "count": int(collected.low_margin.sum()),
        "precision": precision,
        "relative_error": RELATIVE_ERROR[precision],
        "rule": "margin between the two largest outputs of the fp32 F(x) <= relative_error x max |output|",
    }


def build_report(adapter: Adapter, ds: TextDataset, collected: Collected, results: Results, processes: int) -> Report:
    """The result files' contents for `collected` (one entry per sample of `ds`), run in `processes` processes."""
    section, settings, completions, audited = results.section, results.settings, results.completions, results.audited
    structure = adapter.special_ids.non_content()
    if completions is None:
        records = sample_records(collected, ds.texts, adapter.tokens, structure, section.top_k_sample)
        tensors: dict[str, Tensor] = {}
    else:
        records = completions.records(collected, adapter.tokens, structure, section.top_k_sample)
        tensors = completions.tensors(collected)
    messages: list[tuple[Literal["log", "warn"], str]] = []
    deltas = delta_summary(
        collected.deltas,
        collected.scores,
        collected.baseline_scores,
        n_steps=settings.ig.n_steps,
        method=settings.ig.method,
        threshold=section.delta_warning,
    )
    if deltas["warning"]:
        messages.append(("warn", deltas["warning"]))
    steps = _steps(collected, settings, results.stage)
    if steps["full_precision"]:
        messages.append(("log", steps["full_precision"]["note"]))
    if steps["warning"]:
        messages.append(("warn", steps["warning"]))
    if close := int(collected.low_margin.sum()):
        precision = settings.ig.precision
        messages.append(
            (
                "warn",
                f"{close} samples have their two largest outputs within the {precision} error of each other: "
                "the steps may rank them the other way (`low_margin` in attributions.jsonl names them)",
            )
        )
    rate = len(ds) / results.seconds if results.seconds > 0 else None
    top = token_ranking(collected, adapter.tokens, structure, section.top_k, section.min_token_count)
    summary = {
        "n_samples": len(ds),
        "model": adapter.name,
        "data": ds.origin,
        "settings": _settings(settings, section, str(adapter.device)),
        "timing": _timing(results, rate, processes),
        **({} if completions is None else {"completions": completions.summary()}),
        "deltas": deltas,
        "steps": steps,
        "low_margin": low_margin_summary(collected, settings.ig.precision),
        "audit": audited,
        "ranking": RANKING,
        "top_k": top,
        "per_sample_top": "the `top` field of each line of attributions.jsonl",
        "files": dict(FILE_NAMES),
    }
    outcome = {
        "n_samples": len(ds),
        "samples_per_s": rate,
        "delta_median_rel": deltas["median_rel"],
        "top_tokens": [entry["token"] for entry in top[:5]],
        **steps_outcome(steps),
        **({} if audited is None else {"audit": audit_outcome(audited)}),
    }
    return Report(records, summary, outcome, tensors, messages)


def _steps(collected: Collected, settings: Settings, stage: dict[str, Any]) -> dict[str, Any]:
    """The summary's `steps`: the steps taken, the verdicts and the precisions the samples ran in."""
    ig = settings.ig
    chain = precision_chain(ig.precision, ig.tolerance) if ig.full_precision_fallback else []
    steps = steps_summary(
        collected.steps,
        collected.within,
        tolerance=ig.tolerance if ig.n_steps == "auto" else None,
        max_steps=ig.max_steps,
        precision=ig.precision,
        fallback=(collected.fallback, "/".join(chain[1:])) if len(chain) > 1 else None,
    )
    steps["start_precision"] = stage.get("start_precision")
    return steps


def _settings(settings: Settings, section: AttributionSection, device: str) -> dict[str, Any]:
    """The summary's `settings`: the engine's, with the run's device and the section's output settings."""
    return {
        **settings.record(),
        "device": device,
        "batch_size": section.batch_size,
        "length_bucketing": section.length_bucketing,
        "top_k": section.top_k,
        "top_k_sample": section.top_k_sample,
        "min_token_count": section.min_token_count,
    }


def _timing(results: Results, rate: float | None, processes: int) -> dict[str, Any]:
    """The summary's `timing`: the compute of all shards, this attempt's wall time, the compilation."""
    stage, compiler = results.stage, results.compiler
    return {
        "compute_seconds": results.seconds,
        "samples_per_s": rate,
        "processes": processes,
        "attempt_samples": stage["samples"],
        "attempt_seconds": stage["seconds"],
        "attempt_samples_per_s": stage["samples"] / stage["seconds"] if stage["samples"] else None,
        "compile_seconds": None if compiler is None else compiler.compile_seconds,
        "compile_error": None if compiler is None else compiler.error,
    }
