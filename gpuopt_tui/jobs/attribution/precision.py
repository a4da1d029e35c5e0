"""Precision of the interpolation steps: torch.autocast, or a reduced-precision copy of the weights.

Autocast keeps the weights in fp32 and casts per operation: matrix products run in bf16/fp16, but LayerNorm
and the residual stream stay in fp32, so every layer pays for fp32 traffic and for casts back to bf16. With
`cast_weights` the module's floating parameters and buffers are swapped for bf16/fp16 copies while the steps
run (and put back afterwards, untouched) and the forward runs without autocast: every activation is stored in
the reduced type. On BERT-base (seq 128, H200) that is 1.3x the speed of autocast, with a relative error
against fp32 of about 4e-3 in fp16 and 8e-3 in bf16 (benchmarks/results/ig_*.md). fp16 has the finer
mantissa but a range of 65504: `check_finite` reports gradients that overflowed it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gpuopt_tui.core.errors import UserError

REDUCED = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: Relative error of a forward in each step precision against fp32 (the figures above; TF32: about 1e-3).
#: A sample whose top two outputs are closer than this (relative to its largest |output|) may rank them the
#: other way along the path: its `low_margin` flag says so.
RELATIVE_ERROR = {"fp32": 0.0, "tf32": 1e-3, "fp16": 4e-3, "bf16": 8e-3}
#: Why a sample's steps ran in full precision rather than the run's bf16/fp16 (index 0: they did not), as each
#: sample stores it (adaptive.py has the rules; start_precision.py the last).
FALLBACK_REASONS = ("", "output change", "measured rounding", "not settled", "measured speed")


@dataclass(frozen=True)
class StepPrecision:
    """How the forward of the interpolation steps runs."""

    autocast: str  # the precision `jobs.device.autocast` takes: fp32, tf32, bf16 or fp16
    weights: torch.dtype | None  # the dtype of the weights and inputs; None keeps them as they are

    @classmethod
    def of(cls, precision: str, cast_weights: bool = False) -> StepPrecision:
        """`precision` as autocast, or (with `cast_weights` and bf16/fp16) as a cast copy of the weights."""
        if cast_weights and precision in REDUCED:
            return cls("fp32", REDUCED[precision])
        return cls(precision, None)

    def inputs(self, points: Tensor) -> Tensor:
        return points if self.weights is None else points.to(self.weights)

    def context(self, context: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Floating context tensors in the weights' dtype (integer ones, e.g. masks, as they are)."""
        if self.weights is None:
            return dict(context)
        return {k: v.to(self.weights) if v.is_floating_point() else v for k, v in context.items()}


@contextlib.contextmanager
def weights_cast(module: nn.Module | None, dtype: torch.dtype | None) -> Iterator[None]:
    """Run the enclosed code with the floating parameters and buffers of `module` replaced by copies in
    `dtype`; the original tensors are put back afterwards (nothing is lost, they are never rounded)."""
    if module is None or dtype is None:
        yield
        return
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point() and t.dtype != dtype]
    originals = [t.data for t in tensors]
    try:
        for t in tensors:
            t.data = t.data.to(dtype)
        yield
    finally:
        for t, original in zip(tensors, originals):
            t.data = original


def output_margins(outputs: Tensor, precision: str) -> tuple[Tensor, Tensor]:
    """Per sample of fp32 `outputs` [B, C]: the margin between its two largest outputs (inf with one output),
    and whether that margin is within the error of a forward in `precision` (see RELATIVE_ERROR)."""
    flat = outputs.reshape(outputs.shape[0], -1).float()
    if flat.shape[1] < 2:
        margin = torch.full((flat.shape[0],), math.inf, device=flat.device)
    else:
        top = flat.topk(2, dim=1).values
        margin = top[:, 0] - top[:, 1]
    return margin, margin <= RELATIVE_ERROR[precision] * flat.abs().amax(1)


class NonFiniteGradients(UserError):
    """Inf or NaN in the gradients along the path (fp16 overflow, or a model that produces them)."""


def check_finite(integrated_grads: Tensor, precision: str) -> None:
    """A non-finite gradient would silently spoil the results (one device sync per batch)."""
    if not bool(torch.isfinite(integrated_grads).all()):
        hint = " (fp16 overflowed: use amp_dtype = bf16)" if precision == "fp16" else ""
        raise NonFiniteGradients(f"the gradients along the path are not finite in {precision}{hint}")
