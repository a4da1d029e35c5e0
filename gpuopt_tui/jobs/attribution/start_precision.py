"""Which precision a run's batches start their steps in, from what the run measures.

With `n_steps = "auto"`, bf16/fp16 steps and `full_precision_fallback`, a sample that bf16/fp16 cannot resolve
starts over in full precision (adaptive.precision_chain): the points it ran in bf16/fp16 are lost. On a small
model bf16/fp16 is not faster than TF32 at all (its passes are bound by kernel launches, not by arithmetic), and
where many samples fall back the lost points cost more than bf16/fp16 saves (an 8-layer RoBERTa classifier: fp16
1.7x slower than TF32). So the run measures, once, the time of the same steps of its first batch in both
precisions (`PROBE_SAMPLES` samples x `PROBE_STEPS` steps, the faster of two repeats after a warm-up), counts the
samples that fell back in the batches that started in bf16/fp16, and starts the next batch in bf16/fp16 only
while that is expected to take at most `GAIN` of the time of starting in full precision:

    expected = routed + fell_back x (1 + ratio x LOST) + rest x ratio

with the shares of samples routed to full precision before any pass (no points lost), that fell back after
points in bf16/fp16 (LOST: their lost points, as a share of a full-precision run of the sample: an estimate),
and the rest; `ratio` = bf16/fp16 time / full-precision time of the measured steps. Before any batch has been
seen, PRIOR_FELL_BACK of the samples are assumed to fall back: on the conformance models 40-100% of them did, and
the first batch (the longest texts, with length bucketing) paid 2.3x for starting in fp16 on a RoBERTa classifier
whose measured ratio was 0.88 (benchmarks/results/ig_conformance_rates_H200.md). Once a run starts in full
precision it stays there. The choice only decides speed: every sample is refined to its tolerance either way,
and the samples that start in full precision are named (reason "measured speed").

fp16 has a sixteenth of bf16's range: a trained language model's logits can overflow it (a 1B decoder trained
here did, in the probe itself). When the probe's fp16 steps overflow, the run's reduced precision becomes bf16
(where the GPU has it; full precision otherwise) and the probe measures that instead: `overflowed` says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gpuopt_tui.jobs.attribution.adaptive import precision_chain
from gpuopt_tui.jobs.attribution.precision import FALLBACK_REASONS, REDUCED, NonFiniteGradients
from gpuopt_tui.jobs.device import amp_dtype_supported, clock

PROBE_SAMPLES = 64
PROBE_STEPS = 4
GAIN = 0.9  # bf16/fp16 must be expected at least 10% faster to be worth its lost points
LOST = 0.5  # points lost by a sample that falls back, as a share of its points in full precision (an estimate)
PRIOR_FELL_BACK = 0.25  # the share assumed to fall back before a batch has been seen
OUTPUT_CHANGE = FALLBACK_REASONS.index("output change")
MEASURED_SPEED = FALLBACK_REASONS.index("measured speed")

#: Runs the steps of a batch in a precision and returns the seconds they took (synchronised).
TimeFn = Callable[[str], float]


@dataclass
class StartPrecision:
    """The run's choice of the precision its batches start in (the module docstring)."""

    reduced: str  # bf16 or fp16: the run's precision (bf16 once fp16 overflowed)
    full: str  # the next precision of the chain: tf32 or fp32
    ratio: float | None = None  # measured reduced / full time of the same steps
    counts: dict[str, int] = field(default_factory=lambda: {"reduced": 0, "routed": 0, "fell_back": 0, "full": 0})
    bf16: bool = field(default=True, compare=False)  # whether the GPU runs bf16 (where fp16 overflows)
    overflowed: str | None = None  # the precision whose probe overflowed (the module docstring)

    @classmethod
    def of(cls, precision: str, tolerance: float, fallback: bool, device: torch.device) -> StartPrecision | None:
        """The choice for a run of "auto" steps in `precision`, or None where there is nothing to choose."""
        if not fallback or precision not in REDUCED or device.type != "cuda":
            return None
        return cls(precision, precision_chain(precision, tolerance)[1], bf16=amp_dtype_supported(device, "bf16"))

    def choose(self, timed: TimeFn) -> bool:
        """Whether the next batch starts in `reduced` (else in `full`), measuring both with `timed` the first
        time."""
        if self.ratio is None:
            try:
                self.ratio = _measured_ratio(timed, self.reduced, self.full)
            except NonFiniteGradients:
                if self.reduced != "fp16":
                    raise  # bf16 has fp32's range: the model itself gives inf or NaN
                self.overflowed = "fp16"
                if self.bf16:
                    self.reduced = "bf16"
                    self.ratio = _measured_ratio(timed, self.reduced, self.full)
                else:
                    self.ratio = math.inf  # full precision from the start
        return self.expected() <= GAIN

    def expected(self) -> float:
        """Expected time of starting in bf16/fp16 against starting in full precision (1.0)."""
        assert self.ratio is not None
        seen = self.counts["reduced"]
        routed, fell = (self.counts["routed"] / seen, self.counts["fell_back"] / seen) if seen else (0, PRIOR_FELL_BACK)
        return routed + fell * (1 + self.ratio * LOST) + (1 - routed - fell) * self.ratio

    def observe(self, reduced: bool, reasons: Tensor) -> Tensor:
        """Count a batch's samples by their fallback reasons; those of a batch that started in full precision
        (not `reduced`) get the reason "measured speed" (the reasons are returned, relabelled)."""
        if reduced:
            self.counts["reduced"] += reasons.numel()
            self.counts["routed"] += int((reasons == OUTPUT_CHANGE).sum())
            self.counts["fell_back"] += int((reasons > OUTPUT_CHANGE).sum())
            return reasons
        self.counts["full"] += reasons.numel()
        return torch.where(reasons == 0, torch.full_like(reasons, MEASURED_SPEED), reasons)

    def record(self) -> dict[str, Any]:
        """What the summary says about the choice."""
        measured = self.ratio is not None and math.isfinite(self.ratio)  # inf: fp16 overflowed, no bf16 to time
        return {
            "precisions": [self.reduced, self.full],
            "overflowed": self.overflowed,
            "time_ratio": self.ratio if measured else None,
            "expected_ratio": self.expected() if measured else None,
            "samples": dict(self.counts),
            "rule": f"start in {self.reduced} while its expected time (lost points of the samples that fall back "
            f"included) is at most {GAIN:g} x that of starting in {self.full}",
        }

    def describe(self) -> str:
        """The log line of the choice as it stands."""
        chosen = self.reduced if self.expected() <= GAIN else self.full
        overflowed = f"{self.overflowed} overflowed in the probe; " if self.overflowed else ""
        if not math.isfinite(self.ratio or 0):
            return f"steps start in {chosen}: {overflowed}the GPU has no bf16"
        return (
            f"steps start in {chosen}: {overflowed}the same {PROBE_SAMPLES} samples x {PROBE_STEPS} steps took "
            f"{self.ratio:.2f}x the time in {self.reduced} as in {self.full} (bf16/fp16 runs only where at most "
            f"{GAIN:g}x, and the run keeps measuring how many samples fall back)"
        )


def _measured_ratio(timed: TimeFn, reduced: str, full: str) -> float:
    for precision in (reduced, full):  # warm-up: the first call of each pays for kernels and casts
        timed(precision)
    return min(timed(reduced) for _ in range(2)) / max(min(timed(full) for _ in range(2)), 1e-9)


def timer(run: Callable[[str], object], device: torch.device) -> TimeFn:
    """A TimeFn over `run(precision)`, synchronising `device` around it."""

    def timed(precision: str) -> float:
        start = clock(device)
        run(precision)
        return clock(device) - start

    return timed
