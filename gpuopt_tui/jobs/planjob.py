"""The `plan` run kind: a memory plan as a background run (estimate, optional GPU probes, recommendation); for a
family the closed form does not cover, the traced tier estimates and, without probes, searches.

A run never edits the user's config: it saves the recommendation and the diff that would apply it, which
`gpuopt-tui plan --apply` or the planner screen write with a preview and a backup.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from gpuopt_tui.core.atomic import atomic_write_text
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.planner.estimate import Estimate
from gpuopt_tui.core.planner.fit import ProbeResult
from gpuopt_tui.core.planner.measure import MeasuredPlan
from gpuopt_tui.core.planner.search import Candidate, Recommendation
from gpuopt_tui.core.planner.session import (
    device_index,
    estimate_current,
    measure_probes,
    planned_patches,
    prepare,
    recommend_closed_form,
    recommend_measured,
    recommend_traced,
    trace_current,
    trace_probes,
)
from gpuopt_tui.core.planner.traced import TracedEstimate
from gpuopt_tui.core.profiles.plan import PlanProfile
from gpuopt_tui.core.results.plan import CONFIG_DIFF, PLAN_JSON
from gpuopt_tui.jobs.context import JobContext

GIB = 1024**3


def _estimate_json(est: Estimate | TracedEstimate) -> dict[str, Any]:
    return {
        "tier": est.tier,
        "phase": est.phase,
        "allocated": est.allocated,
        "reserved": est.reserved,
        "total": est.total,
        "params": est.params,
        "trainable_params": est.trainable_params,
        "components": [dataclasses.asdict(c) for c in est.components],
    }


def _candidate_json(c: Candidate | None) -> dict[str, Any] | None:
    return dataclasses.asdict(c) if c is not None else None


def _recommendation_json(rec: Recommendation) -> dict[str, Any]:
    return {
        "tier": rec.tier,
        "mode": rec.mode,
        "target_effective_batch": rec.target,
        "largest_micro_batch": rec.b_max,
        "largest_micro_batch_accumulate": rec.b_max_accumulate,
        "budget_bytes": rec.budget.limit,
        "headroom": rec.headroom,  # share of the budget the search kept back for the tier's error
        "chosen": _candidate_json(rec.chosen),
        "current": _candidate_json(rec.current),
        "candidates": [_candidate_json(c) for c in rec.candidates],
        "within_reserve": _candidate_json(rec.within_reserve),
        "stages": [{**dataclasses.asdict(s), "stage": dataclasses.asdict(s.stage)} for s in rec.stages],
    }


def _probe_json(r: ProbeResult) -> dict[str, Any]:
    return {
        "micro_batch": r.micro_batch,
        "sequences": r.sequences,
        "accumulate": r.accumulate,
        "oom": r.oom,
        "peak_reserved": r.max_reserved,
        "peak_allocated": r.max_allocated,
        "alloc_retries": r.num_alloc_retries,
        "context": r.context,
        "seconds": r.seconds,
        "error": r.error,
        "drift": r.drift,
        "step_peaks": list(r.step_peaks),
    }


def _measured_json(m: MeasuredPlan) -> dict[str, Any]:
    """The probes behind a measured recommendation, and the line fitted through them (bytes throughout)."""
    fit = None
    if m.fit is not None:
        fit = {"intercept": m.fit.intercept, "slope_per_sequence": m.fit.slope, "points": list(m.fit.points)}
    return {
        "probes": [_probe_json(r) for r in m.probes],
        "fit": fit,
        "context": m.context,
        "sequences_per_example": m.sequences_per_example,
        "largest_micro_batch": m.b_max,
        "confirmed_micro_batch": m.micro_batch,
    }


def run_job(profile: PlanProfile, ctx: JobContext) -> dict[str, Any]:
    ctx.stage("reading the model and training configs")
    inputs = prepare(profile)
    for r in inputs.values:
        ctx.log(f"{r.label} = {r.text} ({r.source})")
    for warning in inputs.warnings:
        ctx.warn(warning)
    for note in inputs.notes:
        ctx.log(note)
    ctx.progress(0, 3, unit="steps", stage="estimate")
    traced = inputs.spec is None  # a family the closed form does not cover: the traced tier instead
    current: Estimate | TracedEstimate = trace_current(inputs, ctx.log) if traced else estimate_current(inputs)
    ctx.progress(1, 3, unit="steps", stage="estimate")
    measured = None
    if profile.plan.measure:  # the closed form's search is skipped: it may refuse a batch the probes accept
        ctx.check_cancelled()
        ctx.stage("measuring on the GPU", 1, 3, "steps")
        measured = measure_probes(inputs, log=ctx.log)
        rec, measured = recommend_measured(inputs, measured, log=ctx.log)
    elif traced:
        ctx.stage("searching by traces on fake tensors", 1, 3, "steps")
        rec, _ = recommend_traced(inputs, trace_probes(inputs, log=ctx.log), log=ctx.log)
    else:
        rec = recommend_closed_form(inputs)
    ctx.progress(2, 3, unit="steps", stage="recommend")
    plan = {
        "model": inputs.model.label,
        "gpu_index": device_index(profile.run.device),
        "gpu_label": inputs.gpu.label,
        "gpu_total_bytes": inputs.gpu.total,
        "margin": profile.plan.margin,
        "current": _estimate_json(current),
        "recommendation": _recommendation_json(rec),
        "notes": list(inputs.notes),
        "layout": inputs.layout,
        "values": [dataclasses.asdict(r) for r in inputs.values],
        "warnings": list(inputs.warnings),
        "measured": _measured_json(measured) if measured is not None else None,
    }
    out = ctx.results_dir / PLAN_JSON
    atomic_write_text(out, json.dumps(plan, indent=2, default=str))
    ctx.artifact(out, "estimate breakdown and recommended configurations")
    if inputs.config is not None:
        try:
            diff = "".join(p.diff for p in planned_patches(inputs, rec))
        except UserError as e:
            ctx.warn(f"the recommendation cannot be written into the config: {e}")
        else:
            diff_path = ctx.results_dir / CONFIG_DIFF
            atomic_write_text(diff_path, diff or "# the config already has the recommended values\n")
            ctx.artifact(diff_path, "what `gpuopt-tui plan --apply` would change (not applied)")
    ctx.progress(3, 3, unit="steps", stage="done")
    chosen = rec.chosen
    return {
        "tier": rec.tier,
        "headroom": rec.headroom,
        "micro_batch": chosen.micro_batch,
        "accumulate": chosen.accumulate,
        "effective_batch": chosen.effective_batch,
        "peak_gib": round(chosen.peak / GIB, 2),
        "utilisation": round(chosen.utilisation, 3),
        "largest_micro_batch": rec.b_max,
        "current_peak_gib": round(current.total / GIB, 2),
    }
