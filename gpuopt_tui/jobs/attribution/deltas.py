"""Convergence deltas: how far the attributions are from adding up to F(x) - F(baseline)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

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


def within_tolerance(
    deltas: Tensor, scores: Tensor, baseline_scores: Tensor, tolerance: float, floor: float = 0.0
) -> Tensor:
    """Per sample: |delta| <= max(tolerance, floor) x |F(x) - F(baseline)| + `output_floor` (as in
    numpy.isclose: a relative part and an absolute one, so that a sample whose output hardly moves is not
    held to a relative delta of rounding noise over ~0)."""
    change = (scores - baseline_scores).abs()
    return deltas.abs() <= max(tolerance, floor) * change + output_floor(scores, baseline_scores, floor)


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
    within: Tensor,
    *,
    tolerance: float | None,
    max_steps: int,
    precision: str = "fp32",
    full_precision: tuple[int, str] | None = None,
) -> dict[str, Any]:
    """The steps the samples used: total, mean, a histogram [[steps, samples], ...]; with "auto" steps
    (`tolerance` given) also how many samples stopped at the last level with a delta that is not `within` the
    tolerance (see `within_tolerance`), and a warning when there are any, which names full-precision steps as the
    remedy when the steps ran in `precision` fp16 or bf16. `full_precision` (samples, their precision): how many
    samples ran their steps in full precision instead (`full_precision` in the summary, with a note saying why)."""
    values, counts = steps.unique(return_counts=True)
    summary: dict[str, Any] = {
        "mode": "fixed" if tolerance is None else "auto",
        "tolerance": tolerance,
        "max_steps": max_steps if tolerance is not None else None,
        "total": int(steps.sum()),
        "mean": float(steps.double().mean()),
        "histogram": [[int(v), int(c)] for v, c in zip(values, counts)],
        "above_tolerance": None,
        "warning": None,
        "full_precision": None,
    }
    if full_precision is not None and full_precision[0]:
        count, fallback = full_precision
        summary["full_precision"] = {
            "samples": count,
            "precision": fallback,
            "note": (
                f"{count} of {steps.numel()} samples ran their steps in {fallback}, not {precision}: their output "
                f"moves too little between baseline and input for {precision} rounding to stay within the tolerance "
                "(full_precision_fallback; `full_precision` in attributions.jsonl names them, search: fullprecision)"
            ),
        }
    if tolerance is not None:
        above = int((~within).sum())
        summary["above_tolerance"] = above
        if above:
            remedy = (
                f"run the steps in full precision (use_amp = false) or raise max_steps: {precision} steps can keep "
                "a delta from going lower"
                if precision in ("fp16", "bf16")
                else "raise max_steps"
            )
            summary["warning"] = (
                f"{above} of {steps.numel()} samples stopped at {int(steps.max())} steps (max_steps = {max_steps}) "
                f"with a relative convergence delta above the tolerance {tolerance:g}: {remedy}; their `delta` is "
                "in attributions.jsonl"
            )
    return summary


def steps_outcome(summary: dict[str, Any]) -> dict[str, str]:
    """One line each for a run's outcome (what `gpuopt-tui run` prints when it ends) about an "auto" run's steps:
    their spread over the samples and how many stopped above the tolerance; how many ran in full precision."""
    if summary["mode"] != "auto":
        return {}
    counts = [steps for steps, _ in summary["histogram"]]
    outcome = {
        "steps_per_sample": f"mean {summary['mean']:.1f}, {min(counts)} to {max(counts)} "
        f"(tolerance {summary['tolerance']:g}; {summary['above_tolerance']} stopped above it at max_steps)"
    }
    if summary["full_precision"]:
        fallback = summary["full_precision"]
        outcome["full_precision_samples"] = f"{fallback['samples']} (steps in {fallback['precision']})"
    return outcome
