"""The measured tier's arithmetic: a line through probe peaks, the largest batch under a budget, the shrink.

A probe reports torch's peak reserved memory for one training step at a micro-batch; the CUDA context comes on
top (it is invisible to torch). Peak reserved grows linearly with the sequences in a micro-batch once the batch is
large enough that activations, not the optimizer step, make the peak, so the fit uses a medium and a large
batch (tiny batches underestimate the slope).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gpuopt_tui.core.errors import UserError

SHRINK = 0.9


@dataclass(frozen=True)
class ProbeResult:
    """One probe: a training step at `micro_batch` run in a fresh process."""

    micro_batch: int
    sequences: int  # micro_batch x sequences per example
    accumulate: int = 1  # micro-batches per optimizer step (above 1: the gradients of the first are kept)
    oom: bool = False
    max_reserved: int = 0  # torch.cuda.max_memory_reserved() over the measured steps
    max_allocated: int = 0
    num_alloc_retries: int = 0  # cudaMalloc retries after freeing the cache: the allocator was at its limit
    context: int = 0  # memory outside torch's allocator (context, kernels; other processes too) after the steps
    context_at_init: int = 0  # the same when CUDA started, before kernels loaded lazily
    gpu_total: int = 0
    params: int = 0  # of the model the probe built (adapters included)
    trainable_params: int = 0
    device: str = ""
    seconds: float = 0.0
    error: str = ""  # a failure other than out-of-memory
    drift: int = 0  # how far the measured steps' peak reserved rose above the warm-up steps'
    step_peaks: tuple[int, ...] = ()  # peak reserved memory of each step, warm-up included

    @property
    def ok(self) -> bool:
        return not self.oom and not self.error

    @property
    def label(self) -> str:
        """ "b=8", or "b=8 accumulating" for a step of two micro-batches that kept the first's gradients (as the
        batch's accumulation will)."""
        return f"b={self.micro_batch}" + (" accumulating" if self.accumulate > 1 else "")

    @property
    def footprint(self) -> int:
        """The process's peak on the GPU: torch's reserved memory plus the context."""
        return self.max_reserved + self.context

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProbeResult:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        known["step_peaks"] = tuple(known.get("step_peaks", ()))
        return cls(**known)


@dataclass(frozen=True)
class LineFit:
    """peak_reserved(sequences) = intercept + slope x sequences, in bytes."""

    intercept: float
    slope: float
    points: tuple[tuple[int, int], ...]

    def predict(self, sequences: int) -> float:
        return self.intercept + self.slope * sequences


def fit_line(points: Sequence[tuple[int, int]]) -> LineFit:
    """Least-squares line through (sequences, peak reserved bytes) points; needs two distinct batch sizes."""
    xs = [float(x) for x, _ in points]
    ys = [float(y) for _, y in points]
    if len(set(xs)) < 2:
        raise UserError("a line fit needs probes at two different batch sizes")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    if slope <= 0:
        raise UserError(
            "probe peaks did not grow with the batch size (the optimizer step, not activations, sets the peak at "
            "these sizes); probe larger batches"
        )
    return LineFit(intercept=my - slope * mx, slope=slope, points=tuple((int(x), int(y)) for x, y in points))


def max_batch(fit: LineFit, limit: int, context: int, sequences_per_example: int = 1) -> int:
    """b_max = (limit - context - c) / (k x sequences per example), rounded down; 0 if even one does not fit."""
    room = limit - context - fit.intercept
    return max(0, math.floor(room / (fit.slope * sequences_per_example)))


def shrink(batch: int) -> int:
    """The next batch to try after an out-of-memory error or allocator retries: x0.9, at least one less."""
    return max(1, min(batch - 1, math.floor(batch * SHRINK)))
