"""`n_steps = "auto"`: nested Clenshaw-Curtis levels, each sample refined until its completeness delta is
within a tolerance.

Level k has 2^(k+2) + 1 points (5, 9, 17, 33, ...), and its points hold all those of level k - 1: a refinement
evaluates only the new points (the odd ones). The weight a point carries differs from level to level, but
every weight is known once the levels are fixed, so when a point's gradient is computed it is added, with
its weight in each level from its own up to the cap, into one running sum per level. The sum of level k is
then exactly level k's rule applied to all its points, with no gradient kept and none computed twice.

A sample stops at the first level (from the second on) where both its |delta| and the change of its token
scores from the previous level (max |change|) are within the tolerance, or at the last level (the cap). The
steps' precision bounds what either test can resolve (`precision_floor`, "floor" below): a tolerance below
the floor is raised to it (`tolerance_warning` says so up front), and each test has an absolute part as well
(as numpy.isclose), so that a sample whose output hardly moves between baseline and input is not refined to the
cap on rounding noise over ~0:
    |delta|      <= max(tolerance, floor) x |F(x) - F(baseline)| + floor    x max(|F(x)|, |F(baseline)|)
    max |change| <= max(tolerance, floor) x max |score|          + rounding x max(|F(x)|, |F(baseline)|)
The delta's absolute part is the steps' precision: the path's model (16-bit weights) and the fp32 ends differ by
about that much. The change's is only the accumulation's rounding (`rounding_floor`): two levels share all the
coarser level's points, so low-precision steps move their difference far less than the floor; an absolute part
of floor x |F(x)| let a sample with a small |F(x) - F(baseline)| and a large |F(x)| stop at 9 points with token
scores 4% off on a fine-tuned BERT. The delta alone is one number: the token errors can cancel in it, so that a
coarse level looks converged by chance. The change from the previous level estimates the previous level's
error, which the finer level's is usually far below. Every sample of a batch that goes on needs the same new
points, so a refinement pass is an ordinary pass of the engine over the unconverged samples only, its chunks
filled with more steps as fewer samples remain.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.attribution.deltas import output_floor
from gpuopt_tui.jobs.attribution.precision import RELATIVE_ERROR
from gpuopt_tui.jobs.attribution.rules import clenshaw_curtis

FIRST_INTERVALS = 4  # the first level: 5 points (no sample stops there: the second level, 9 points, is the least)
RULE = "clenshaw_curtis"
ROUNDING_FLOOR = 64  # in full precision: the floor in units of the accumulation dtype's eps


def precision_floor(precision: str, dtype: torch.dtype = torch.float32) -> float:
    """The smallest relative delta and level-to-level change that steps in `precision` can resolve: the
    relative error of their forward against fp32 (precision.RELATIVE_ERROR: 4e-3 in fp16, 8e-3 in bf16), or a
    few rounding units of `dtype` (the accumulation dtype) in full precision."""
    return max(RELATIVE_ERROR[precision], rounding_floor(dtype))


def rounding_floor(dtype: torch.dtype = torch.float32) -> float:
    """A few rounding units of the accumulation `dtype`: what summing the steps' gradients alone can move a
    token score by, relative to the explained output."""
    return ROUNDING_FLOOR * torch.finfo(dtype).eps


def tolerance_warning(tolerance: float, precision: str, dtype: torch.dtype = torch.float32) -> str | None:
    """What a run to `tolerance` with steps in `precision` should say up front, if anything."""
    floor = precision_floor(precision, dtype)
    if tolerance >= floor:
        return None
    return (
        f"tolerance {tolerance:g} is below what {precision} steps can resolve (about {floor:.0e} relative): "
        f"samples stop once within {floor:.0e}; for a tighter result run the steps in fp32 (use_amp = false)"
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


@dataclass(frozen=True)
class Level:
    """The points a level adds and their weights in it and every later level."""

    points: int  # points of the level in all (steps a sample that stops here has used)
    alphas: np.ndarray  # [new] the points it adds
    weights: np.ndarray  # [new, levels from this one to the last]


def level_points(max_steps: int) -> list[int]:
    """Points of each level, up to the largest within `max_steps`."""
    if max_steps < 2 * FIRST_INTERVALS + 1:
        raise UserError(f"attribution.max_steps must be at least {2 * FIRST_INTERVALS + 1}, got {max_steps}")
    points, intervals = [], FIRST_INTERVALS
    while intervals + 1 <= max_steps:
        points.append(intervals + 1)
        intervals *= 2
    return points


@functools.lru_cache(maxsize=8)
def nested_levels(max_steps: int) -> tuple[Level, ...]:
    """The levels of a run whose cap is `max_steps` (see the module docstring)."""
    finest = level_points(max_steps)[-1] - 1
    rules = [clenshaw_curtis(points - 1)[1] for points in level_points(max_steps)]
    alphas = clenshaw_curtis(finest)[0]  # every level's points are points of the finest level
    levels = []
    for k, weights in enumerate(rules):
        intervals = len(weights) - 1
        stride = finest // intervals
        new = np.arange(0, intervals + 1) if k == 0 else np.arange(1, intervals + 1, 2)
        later = [rules[m][new * (2 ** (m - k))] for m in range(k, len(rules))]
        levels.append(Level(intervals + 1, alphas[new * stride], np.stack(later, axis=1)))
    return tuple(levels)
