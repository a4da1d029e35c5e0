"""Convergence deltas: how far the attributions are from adding up to F(x) - F(baseline)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gpuopt_tui.jobs.attribution.panels import NEW_POINTS
from gpuopt_tui.jobs.attribution.precision import FALLBACK_REASONS
from gpuopt_tui.jobs.attribution.rules import CONVERGENCE_ORDER

MIN_DIFFERENCE = 1e-6  # |F(x) - F(baseline)| below this is treated as this (avoids dividing by ~0)


def relative_deltas(deltas: Tensor, scores: Tensor, baseline_scores: Tensor) -> Tensor:
    """|delta| / |F(x) - F(baseline)| per sample."""
    return deltas.abs() / (scores - baseline_scores).abs().clamp_min(MIN_DIFFERENCE)


def output_floor(scores: Tensor, baseline_scores: Tensor, floor: float) -> Tensor:
    """The absolute part of a tolerance: `floor` (the relative error of the steps' precision, see
    adaptive.precision_floor) x max(|F(x)|, |F(baseline)|), what rounding alone can move a sum of
    attributions by, however little the output moves between baseline and input."""
    return floor * torch.maximum(scores.abs(), baseline_scores.abs())


def delta_summary(
    deltas: Tensor, scores: Tensor, baseline_scores: Tensor, *, n_steps: int | str, method: str, threshold: float
) -> dict[str, Any]:
    """Median and p95 of |delta| and of the relative delta, and a warning with a suggested step count when the
    integral looks unconverged (assuming the rule's error shrinks as n_steps^-order): when the median relative
    delta exceeds `threshold`, or when a tail does: the 95th percentile of |delta| against the median
    |F(x) - F(baseline)|. The tail is not measured per sample: a sample whose output hardly moves between
    baseline and input has a large relative delta from rounding alone, whatever the step count. With "auto"
    steps there is no step count to suggest (`steps_summary` tells which samples stopped at the cap)."""
    rel = relative_deltas(deltas, scores, baseline_scores).double()
    absolute = deltas.abs().double()
    median_rel = float(rel.median())
    scale = max(float((scores - baseline_scores).abs().double().median()), MIN_DIFFERENCE)
    tail = float(torch.quantile(absolute, 0.95)) / scale
    summary: dict[str, Any] = {
        "median_abs": float(absolute.median()),
        "p95_abs": float(torch.quantile(absolute, 0.95)),
        "median_rel": median_rel,
        "p95_rel": float(torch.quantile(rel, 0.95)),
        "max_rel": float(rel.max()),
        "p95_abs_vs_median_change": tail,
        "threshold_rel": threshold,
        "warning": None,
        "suggested_n_steps": None,
    }
    if not isinstance(n_steps, int) or not threshold > 0 or max(median_rel, tail) <= threshold:
        return summary
    excess = (median_rel if median_rel > threshold else tail) / threshold
    suggested = round(n_steps * excess ** (1.0 / CONVERGENCE_ORDER[method]))
    suggested = min(100_000, _round_up(max(suggested, n_steps + 1)))
    summary["suggested_n_steps"] = suggested
    if median_rel > threshold:
        found = f"median convergence delta is {median_rel:.1%} of F(x) - F(baseline) (threshold {threshold:.1%})"
        unconverged = "the integral is not converged"
    else:
        above = int((absolute > threshold * scale).sum())
        found = (
            f"{above} of {rel.numel()} samples have a convergence delta above {threshold:.1%} of the median "
            f"|F(x) - F(baseline)|, which is {scale:.3g} (95th percentile: {tail:.1%})"
        )
        unconverged = "their attributions are not converged (`delta` in attributions.jsonl names them)"
    summary["warning"] = f"{found}: {unconverged}; try n_steps = {suggested}"
    return summary


def _round_up(n: int) -> int:
    """Round up to 2 significant digits (e.g. 137 -> 140, 2412 -> 2500)."""
    unit = 10 ** max(0, len(str(n)) - 2)
    return -(-n // unit) * unit


def steps_summary(
    steps: Tensor,
    within: Tensor | None,
    *,
    tolerance: float | None,
    max_steps: int,
    precision: str = "fp32",
    fallback: tuple[Tensor, str] | None = None,
) -> dict[str, Any]:
    """The steps the samples used: total, mean, a histogram [[steps, samples], ...]; with "auto" steps
    (`tolerance` given) also how many samples are not `within` the tolerance (the engine's verdict), which, and a
    warning naming the remedy for each cause. `fallback` (each sample's reason, precision.FALLBACK_REASONS, and
    the full precision): how many samples ran their steps in full precision instead of `precision`, and why."""
    values, counts = steps.unique(return_counts=True)
    summary: dict[str, Any] = {
        "mode": "fixed" if tolerance is None else "auto",
        "tolerance": tolerance,
        "max_steps": max_steps if tolerance is not None else None,
        "total": int(steps.sum()),
        "mean": float(steps.double().mean()),
        "histogram": [[int(v), int(c)] for v, c in zip(values, counts)],
        "above_tolerance": None,
        "above_tolerance_samples": None,
        "warning": None,
        "full_precision": None if fallback is None else _full_precision(fallback, precision),
    }
    if tolerance is not None and within is not None:
        above = ~within
        summary["above_tolerance"] = int(above.sum())
        summary["above_tolerance_samples"] = above.nonzero().squeeze(1)[:LISTED].tolist()
        summary["warning"] = _above_warning(steps, above, tolerance, max_steps, precision, fallback is not None)
    return summary


LISTED = 50  # samples above the tolerance named in the summary (attributions.jsonl marks every one)


def _full_precision(fallback: tuple[Tensor, str], precision: str) -> dict[str, Any] | None:
    """How many samples ran in the full precision, in all and per reason; None when none did."""
    reasons, full = fallback
    count = int((reasons > 0).sum())
    if not count:
        return None
    by_reason = {name: int((reasons == i).sum()) for i, name in enumerate(FALLBACK_REASONS) if i}
    why = ", ".join(f"{n} {name}" for name, n in by_reason.items() if n)
    return {
        "samples": count,
        "precision": full,
        "by_reason": by_reason,
        "note": (
            f"{count} of {reasons.numel()} samples ran their steps in {full}, not {precision} ({why}: their output "
            f"moves too little for {precision}, the rounding measured on their first points would take half the "
            f"tolerance, they had not settled in {precision}, or the run measured that starting in {full} is "
            "faster); `full_precision` in attributions.jsonl names them (search: fullprecision)"
        ),
    }


def _above_warning(
    steps: Tensor, above: Tensor, tolerance: float, max_steps: int, precision: str, fallback: bool
) -> str | None:
    """What a run with samples above the tolerance says, with the remedy of each cause."""
    count = int(above.sum())
    if not count:
        return None
    at_cap = int((above & (steps + NEW_POINTS > max_steps)).sum())
    causes = []
    if at_cap:
        remedy = "raise max_steps"
        if precision in ("bf16", "fp16") and not fallback:
            remedy += " or let them run in full precision (full_precision_fallback = true, or use_amp = false)"
        causes.append(f"{at_cap} stopped at max_steps = {max_steps} ({remedy})")
    if rest := count - at_cap:
        causes.append(f"{rest} settled as they stopped but not once weighted in fp32 (a borderline delta)")
    return (
        f"{count} of {steps.numel()} samples are above the tolerance {tolerance:g} (their relative delta or error "
        f"estimate): {'; '.join(causes)}; `within_tolerance` in attributions.jsonl names them (search: abovetol)"
    )


def steps_outcome(summary: dict[str, Any]) -> dict[str, str]:
    """One line each for a run's outcome (what `gpuopt-tui run` prints when it ends) about an "auto" run's steps:
    their spread over the samples and how many are above the tolerance; how many ran in full precision."""
    if summary["mode"] != "auto":
        return {}
    counts = [steps for steps, _ in summary["histogram"]]
    outcome = {
        "steps_per_sample": f"mean {summary['mean']:.1f}, {min(counts)} to {max(counts)} "
        f"(tolerance {summary['tolerance']:g}; {summary['above_tolerance']} above it)"
    }
    if summary["full_precision"]:
        fallback = summary["full_precision"]
        outcome["full_precision_samples"] = f"{fallback['samples']} (steps in {fallback['precision']})"
    return outcome
