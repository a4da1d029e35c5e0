"""`n_steps = "auto"`: each sample's path integral refined where its error is, until it is within a tolerance.

The rule is adaptive Simpson on panels (panels.py): every sample starts on four panels of [0, 1] (17 points); each
later pass splits, for each sample that has not converged, its two panels of largest error estimate (8 new
points), reusing every point already evaluated. On a fine-tuned classifier the output turns from one class to
the other over a short stretch of the path (a few hundredths of it, somewhere in its first half): the panels
gather there, where a rule on fixed points (Clenshaw-Curtis, Gauss-Legendre) needs hundreds of points over the
whole path to resolve it (benchmarks/results/ig_rules_offline_H100.md).

A sample is within the tolerance when the two figures written for it are (`standing`, one test for stopping and
for the verdict the results carry):
    relative delta      |delta| / |F(x) - F(baseline)|                                      <= tolerance
    relative error      max over tokens t of (SAFETY x error estimate of t + rounding x integral of |g_t|)
                        / max over tokens |score|                                           <= tolerance
The error estimate of a token is the sum over panels of |S5 - S3| (Simpson's rule on a panel's 5 points against
its 3: the error of the coarser of the two; the scores are Boole's rule, a higher order). On a smooth integrand
it is far above Boole's error; on a panel holding a jump of the integrand (a ReLU or another kink in the model)
Boole's error can reach about twice |S5 - S3| (a step just inside a panel's first quarter: 0.17 against 0.083 of
its width), hence SAFETY = 2: a DistilBERT classifier (a ReLU in its head) trained here had samples stop 1.1e-3
off at a tolerance of 1e-3 with SAFETY = 1 (benchmarks/results/ig_conformance_H200_safety1.md). The rounding part
is what the steps' precision adds: a few units of the accumulation's eps in full precision, and in bf16/fp16 the
rounding measured on the sample itself (`probe_rounding`). Nothing is raised to a precision floor and there is
no absolute part: a sample is never reported within a tolerance that its own written delta exceeds.

Assumptions, where the estimate is an estimate and not a proof: the integrand is resolved by the panels (a
feature narrower than a panel that falls between its 5 points is not seen; the 17-point start is there for it),
and it is smooth or has jumps, not worse (noise of the steps' rounding is the rounding part's). The run's audit
(audit.py) checks it on samples of every run.

Precision is chosen per sample, from evidence: with `full_precision_fallback` a sample moves along
`precision_chain` (bf16/fp16, TF32 -- or fp32 below a tolerance of 1e-3 --, fp32), starting over in the next
precision: from bf16/fp16 before its first pass when its output moves too little for their rounding
(`needs_full_precision`), or once it has not settled within REDUCED_CAP points; from any precision but fp32 after
its first pass when the rounding measured at two of its points against the next precision (`probe_rounding`)
would take half its tolerance (TF32 samples at 1e-3 on a RoBERTa and an ALBERT classifier trained here stopped up
to 1.6e-3 off before TF32 was probed: benchmarks/results/ig_conformance_H200.md). A sample that cannot settle
stops at `max_steps` (the cap) and is counted and flagged above the tolerance.
Every sample of a pass gets the same number of new points, at its own positions, so a pass is an ordinary pass of
the engine over the unconverged samples only.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.attribution.deltas import MIN_DIFFERENCE, output_floor
from gpuopt_tui.jobs.attribution.panels import MIN_STEPS, NEW_POINTS, SamplePanels
from gpuopt_tui.jobs.attribution.precision import REDUCED, RELATIVE_ERROR

RULE = "adaptive_simpson"  # the `method` runs with "auto" steps report
ROUNDING_FLOOR = 64  # in full precision: the rounding part in units of the accumulation dtype's eps
REDUCED_CAP = 129  # bf16/fp16 samples not settled at this many points move to full precision (with the fallback)
SAFETY = 2.0  # the error estimate's factor (the module docstring)
PROBE_POINTS = 2  # points of the first pass computed in full precision too, to measure a sample's rounding
PROBE_SHARE = 0.5  # measured rounding above this share of the tolerance: the sample moves to full precision


def precision_floor(precision: str, dtype: torch.dtype = torch.float32) -> float:
    """The relative error of a forward in `precision` against fp32 (precision.RELATIVE_ERROR: 4e-3 in fp16, 8e-3
    in bf16), or a few rounding units of `dtype` (the accumulation dtype) in full precision."""
    return max(RELATIVE_ERROR[precision], ROUNDING_FLOOR * torch.finfo(dtype).eps)


# the switch to finer steps, by the precision the steps run in (fp32 steps have none: their floor is rounding)
FINER_STEPS = {
    "fp16": "run the steps in fp32 (use_amp = false)",
    "bf16": "run the steps in fp32 (use_amp = false)",
    "tf32": "run the steps in plain fp32 (tf32 = false)",
}


def tolerance_warning(tolerance: float, precision: str, fallback: bool) -> str | None:
    """What a run to `tolerance` with steps in `precision` should say up front, if anything."""
    floor = precision_floor(precision)
    if tolerance >= floor:
        return None
    if fallback and precision != "fp32":
        return (
            f"tolerance {tolerance:g} is below what {precision} steps resolve (about {floor:.0e} relative): most "
            f"samples will run their steps in {precision_chain(precision, tolerance)[1]} (full_precision_fallback)"
        )
    finer = FINER_STEPS.get(precision)
    return (
        f"tolerance {tolerance:g} is below what {precision} steps resolve (about {floor:.0e} relative): samples "
        "that cannot reach it stop at max_steps and are flagged above it"
        + (f"; for a tighter result {finer}" if finer else "")
    )


WIDE_BATCH = 128  # the batch size the note below suggests (the figure is in attribution.batch_size's help)


def batch_size_note(batch_size: int, samples: int, device_type: str) -> str | None:
    """What a GPU run with auto steps should say when its batches keep the refinement passes small."""
    if device_type != "cuda" or batch_size >= min(WIDE_BATCH, samples):
        return None
    return (
        f"note: with auto steps each refinement pass runs only the samples still refining, {NEW_POINTS} points "
        f"each, so batch_size = {batch_size} keeps the passes small; batches of {WIDE_BATCH} keep a GPU busier "
        "(see attribution.batch_size's help)"
    )


def needs_full_precision(
    scores: Tensor, baseline_scores: Tensor, tolerance: float, precision: str, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Per sample [B]: whether steps in `precision` cannot reach `tolerance` because the output moves too little
    between baseline and input: their rounding, floor x max(|F(x)|, |F(baseline)|), exceeds the tolerance's
    share of |F(x) - F(baseline)| (low-precision rounding is relative to the size of the outputs, not to their
    change)."""
    floor = precision_floor(precision, dtype)
    return output_floor(scores, baseline_scores, floor) > tolerance * (scores - baseline_scores).abs()


def full_precision(tolerance: float) -> str:
    """The precision samples move to from bf16/fp16: TF32 (fp32 storage, TF32 products; plain fp32 where there
    is no TF32) when the tolerance is within its resolution, else fp32."""
    return "tf32" if tolerance >= precision_floor("tf32") else "fp32"


def precision_chain(precision: str, tolerance: float) -> list[str]:
    """The precisions a sample of a run in `precision` may move through, the run's first: bf16/fp16, then
    `full_precision`, then fp32; TF32, then fp32; fp32 alone."""
    if precision in REDUCED:
        return [precision, *dict.fromkeys([full_precision(tolerance), "fp32"])]
    return ["tf32", "fp32"] if precision == "tf32" else [precision]


def check_max_steps(max_steps: int) -> None:
    """A cap below the first pass's points is an error of the profile."""
    if max_steps < MIN_STEPS:
        raise UserError(f"attribution.max_steps must be at least {MIN_STEPS}, got {max_steps}")


class Standing(NamedTuple):
    """Where a sample stands against the tolerance (the module docstring's two figures)."""

    within: bool
    relative_delta: float
    relative_error: float
    panel_errors: np.ndarray  # each panel's largest |S5 - S3| over the tokens (what `SamplePanels.split` takes)


def standing(sample: SamplePanels, ends: tuple[float, float], tolerance: float, rounding: float) -> Standing:
    """`sample`'s standing for the explained outputs `ends` = F(x), F(baseline) and the relative `rounding` of
    its steps' integrand (`accumulation_rounding`, or a measured one: `probe_rounding`)."""
    now = sample.estimate()
    change = ends[0] - ends[1]
    relative_delta = abs(float(now.scores.sum()) - change) / max(abs(change), MIN_DIFFERENCE)
    error = float((SAFETY * now.error + rounding * now.magnitude).max())
    size = float(np.abs(now.scores).max())
    relative_error = error / size if size > 0 else (0.0 if error == 0 else math.inf)
    within = relative_delta <= tolerance and relative_error <= tolerance
    return Standing(within, relative_delta, relative_error, now.panel_errors)


def accumulation_rounding(dtype: torch.dtype) -> float:
    """The rounding part of the estimate in full precision: a few units of the accumulation dtype's eps."""
    return precision_floor("fp32", dtype)


def probe_rounding(low: np.ndarray, full: np.ndarray) -> float:
    """A sample's measured relative rounding: its integrand at the same points in the steps' precision (`low`)
    and in full precision (`full`), both [points, tokens]: the largest over the points of
    sum_t |low_t - full_t| / sum_t |full_t|."""
    spread = np.abs(low - full).sum(1) / np.maximum(np.abs(full).sum(1), np.finfo(np.float64).tiny)
    return float(spread.max())


def rounding_too_large(sample: SamplePanels, ends: tuple[float, float], tolerance: float, rounding: float) -> bool:
    """Whether a measured `rounding` would take more than PROBE_SHARE of the tolerance of either figure: the
    delta (rounding of every token adds up) or the token scores."""
    now = sample.estimate()
    share = PROBE_SHARE * tolerance
    in_delta = rounding * float(now.magnitude.sum()) > share * abs(ends[0] - ends[1])
    in_scores = rounding * float(now.magnitude.max()) > share * float(np.abs(now.scores).max())
    return in_delta or in_scores
