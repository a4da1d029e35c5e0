"""`n_steps = "auto"`: each sample's path integral refined where its error is, until it is within a tolerance.

The rule is adaptive Simpson on panels (panels.py): every sample starts on four panels of [0, 1] (17 points); each
later pass splits, for each sample that has not converged, its two panels of largest error estimate (8 new
points), reusing every point already evaluated. On a fine-tuned classifier the output turns from one class to
the other over a short stretch of the path (a few hundredths of it, somewhere in its first half): the panels
gather there, where a rule on fixed points (Clenshaw-Curtis, Gauss-Legendre) needs hundreds of points over the
whole path to resolve it (benchmarks/results/ig_rules_offline_H100.md).

A sample stops at the first pass after which both its |delta| and the error estimate of its token scores (per
token, the sum over panels of |S5 - S3|: Simpson's rule on a panel's 5 points against its 3, the error of the
coarser of the two; the scores are Boole's rule, a higher order) are within the tolerance, or when one more pass
would take it over `max_steps` (the cap). The steps' precision bounds what either test can resolve
(`precision_floor`, "floor" below): a tolerance below the floor is raised to it (`tolerance_warning` says so up
front), and each test has an absolute part as well (as numpy.isclose), so that rounding noise over ~0 does not
refine a sample to the cap:
    |delta|             <= max(tolerance, floor) x |F(x) - F(baseline)|  + floor    x max(|F(x)|, |F(baseline)|)
    error estimate of t <= max(tolerance, floor) x max_t' |score of t'| + rounding x integral of |g_t|
The delta's absolute part: the path's model (16-bit weights) and the fp32 ends differ by about the floor. The
estimate's is only the accumulation's rounding (a few units of its eps), the strict choice: 16-bit rounding of the
integrand did not drive samples to the cap on a fine-tuned BERT-base (none of 2048 at 1e-2 or 1e-3 in
benchmarks/results/ig_auto_panels17_H100.md and ig_auto_panels17_tol1e-3_H100.md), and an absolute part of floor
x the integral of |g_t| would let a sample whose integrands cancel along the path stop on a large estimate. The
delta alone is one number, in which the token errors can cancel. Every sample of a pass gets the same number of
new points, at its own positions, so a pass is an ordinary pass of the engine over the unconverged samples only.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.attribution.deltas import output_floor, within_tolerance
from gpuopt_tui.jobs.attribution.panels import MIN_STEPS, NEW_POINTS, SamplePanels
from gpuopt_tui.jobs.attribution.precision import RELATIVE_ERROR

RULE = "adaptive_simpson"  # the `method` runs with "auto" steps report
ROUNDING_FLOOR = 64  # in full precision: the floor in units of the accumulation dtype's eps


def precision_floor(precision: str, dtype: torch.dtype = torch.float32) -> float:
    """The smallest relative delta and level-to-level change that steps in `precision` can resolve: the
    relative error of their forward against fp32 (precision.RELATIVE_ERROR: 4e-3 in fp16, 8e-3 in bf16), or a
    few rounding units of `dtype` (the accumulation dtype) in full precision."""
    return max(RELATIVE_ERROR[precision], ROUNDING_FLOOR * torch.finfo(dtype).eps)


# the switch to finer steps, by the precision the steps run in (fp32 steps have none: their floor is rounding)
FINER_STEPS = {
    "fp16": "run the steps in fp32 (use_amp = false)",
    "bf16": "run the steps in fp32 (use_amp = false)",
    "tf32": "run the steps in plain fp32 (tf32 = false)",
}


def tolerance_warning(tolerance: float, precision: str, dtype: torch.dtype = torch.float32) -> str | None:
    """What a run to `tolerance` with steps in `precision` should say up front, if anything."""
    floor = precision_floor(precision, dtype)
    if tolerance >= floor:
        return None
    finer = FINER_STEPS.get(precision)
    return (
        f"tolerance {tolerance:g} is below what {precision} steps can resolve (about {floor:.0e} relative): "
        f"samples stop once within {floor:.0e}" + (f"; for a tighter result {finer}" if finer else "")
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
    """Per sample [B]: whether steps in `precision` cannot reach `tolerance`, because the output moves too little
    between baseline and input: the floor's absolute part, floor x max(|F(x)|, |F(baseline)|), exceeds the
    tolerance's share of |F(x) - F(baseline)|. Low-precision rounding is relative to the size of the outputs,
    not to their change: such a sample's token scores can be off by more than the tolerance however many steps
    it gets (the tests above would stop it on the absolute part)."""
    floor = precision_floor(precision, dtype)
    return output_floor(scores, baseline_scores, floor) > tolerance * (scores - baseline_scores).abs()


def full_precision(tolerance: float) -> str:
    """The precision the samples of `needs_full_precision` run in: TF32 (fp32 storage, TF32 products; plain fp32
    where there is no TF32) when the tolerance is within its resolution, else fp32."""
    return "tf32" if tolerance >= precision_floor("tf32") else "fp32"


def check_max_steps(max_steps: int) -> None:
    """A cap below the first pass's points is an error of the profile."""
    if max_steps < MIN_STEPS:
        raise UserError(f"attribution.max_steps must be at least {MIN_STEPS}, got {max_steps}")


def settled(
    sample: SamplePanels, ends: tuple[float, float], tolerance: float, floor: float, dtype: torch.dtype
) -> tuple[bool, np.ndarray]:
    """Whether `sample` may stop (both tests of the module docstring, for the explained outputs `ends` = F(x),
    F(baseline) and the steps' precision `floor`; `dtype` the accumulation's), and each panel's largest error
    (what `SamplePanels.split` takes when it may not)."""
    now = sample.estimate()
    f_x, f_b = (torch.tensor([end], dtype=torch.float64) for end in ends)
    delta = torch.tensor([now.scores.sum()], dtype=torch.float64) - (f_x - f_b)
    rounding = precision_floor("fp32", dtype)
    resolved = (now.error <= max(tolerance, floor) * np.abs(now.scores).max() + rounding * now.magnitude).all()
    return bool(resolved and within_tolerance(delta, f_x, f_b, tolerance, floor).all()), now.panel_errors
