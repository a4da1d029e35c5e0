"""The integration settings of the IG engine (`integrated_gradients`, `integrated_gradients_reference`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class IGOptions:
    """How the path integral of Integrated Gradients is computed; the defaults are the engine's.

    n_steps (int or "auto", default 50):
        Points on the straight path from the baseline to the input. "auto" refines each sample on adaptive
        Simpson panels until it settles within `tolerance` or one more pass would exceed `max_steps`
        (adaptive.py); `method` is then not used. The reference loop takes integers only.
    method (str, default "gausslegendre"):
        The quadrature rule of fixed steps, one of rules.METHODS ("riemann_left", "riemann_right",
        "riemann_middle", "riemann_trapezoid", "gausslegendre", "clenshaw_curtis").
    tolerance (float, default 1e-2):
        "auto" steps: the bound on each sample's relative completeness delta and on the relative error estimate
        of its token scores; also decides when reduced precision is too coarse for a sample (adaptive.py).
    max_steps (int, default 1025):
        "auto" steps: the most points a sample may take; one that has not settled by then is reported as not
        within the tolerance.
    alpha_batch_size (int, "auto" or None, default None):
        Steps per chunk (all samples of the batch x this many steps per forward/backward pass); "auto" fits the
        GPU memory, None runs all steps at once. A chunk that runs out of GPU memory is halved and retried
        (chunking.ChunkPlanner). Not used when the call is given a shared `planner`.
    precision (str, default "fp32"):
        The step forwards' precision: "fp32", "tf32", or "bf16"/"fp16" autocast (precision.py). The endpoints
        F(x) and F(baseline) never run autocast (see `endpoint_precision`); gradients are summed in fp32.
    cast_weights (bool, default False):
        With bf16/fp16: run the steps on a copy of the weights cast to that dtype, without autocast.
    full_precision_fallback (bool, default False):
        "auto" steps: move a sample along adaptive.precision_chain (bf16/fp16 -> TF32 -> fp32) when its output
        moves too little for its precision, when it has not settled within adaptive.REDUCED_CAP points, or when
        the rounding measured on its first pass would take half its tolerance; the result's `fallback` says why.
    per_dimension (bool, default True):
        Attributions per embedding dimension [B, *S, H]; False sums them to token scores [B, *S, 1], and "auto"
        steps then keep only each token's integrand, not the gradients (memory independent of the embedding
        size). The reference loop always computes them per dimension.
    endpoint_precision (str or None, default None):
        The precision of F(x) and F(baseline) (and so of the target, the prediction and the completeness
        deltas): None for common.resolve_endpoint_precision's choice (fp32), or "tf32".
    """

    n_steps: int | Literal["auto"] = 50
    method: str = "gausslegendre"
    tolerance: float = 1e-2
    max_steps: int = 1025
    alpha_batch_size: int | Literal["auto"] | None = None
    precision: str = "fp32"
    cast_weights: bool = False
    full_precision_fallback: bool = False
    per_dimension: bool = True
    endpoint_precision: str | None = None


DEFAULT_OPTIONS = IGOptions()
