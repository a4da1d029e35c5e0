"""torch.compile for the forward of the interpolation steps.

Only that forward is compiled: F(x) and F(baseline) run eagerly, and `torch.autograd.grad` is called outside
the compiled region (AOTAutograd compiles the matching backward). Shapes are dynamic, so batches of other
lengths or sizes reuse the one compiled graph instead of compiling again. One `StepCompiler` serves a whole
run; compiling costs tens of seconds (see `compile_seconds`), which only long runs earn back. If compiling
fails, the steps fall back to the eager forward for the rest of the run and `error` says why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gpuopt_tui.jobs.attribution.common import ForwardFn
from gpuopt_tui.jobs.event_hook import EventFn, EventReporter

#: `auto` compiles runs of at least this many (sample, step) pairs. Measured on BERT-base (seq 128, H200,
#: benchmarks/results/ig_variants_H200.md): compiling takes 20-40 s and makes the steps of the lean forward
#: 5-8% faster, at ~8500 sample-steps/s; 5 million is ~10 min of steps, where the gain covers the compiling.
AUTO_MIN_SAMPLE_STEPS = 5_000_000
#: Steps a sample is counted for when its steps are "auto" (most samples stop within 17 to 65).
AUTO_STEPS_ESTIMATE = 64


def should_compile(setting: str, device: torch.device, samples: int, steps: int | str) -> bool:
    """Resolve a profile's `compile` ("on", "off" or "auto") for a run of `samples` x `steps` on `device`."""
    if setting == "auto":
        per_sample = steps if isinstance(steps, int) else AUTO_STEPS_ESTIMATE
        return device.type == "cuda" and samples * per_sample >= AUTO_MIN_SAMPLE_STEPS
    return setting == "on"


class StepCompiler(EventReporter):
    """Compiles step forwards lazily (on their first call) and records what compiling cost."""

    def __init__(
        self,
        *,
        backend: str = "inductor",
        dynamic: bool = True,
        options: dict[str, Any] | None = None,
        on_event: EventFn | None = None,
        on_compiling: Callable[[], None] | None = None,
    ) -> None:
        self.backend = backend
        self.dynamic = dynamic  # False: one graph per input shape (each new shape compiles again)
        self.options = options  # the backend's settings (inductor: max_autotune, triton.cudagraphs, ...)
        self.on_event = on_event
        self.on_compiling = on_compiling  # called as a compilation starts (it takes seconds to minutes)
        self.compile_seconds = 0.0  # wall time of the chunks that compiled: compiling plus their work
        self.error: str | None = None  # why compiling failed; the steps then run eagerly
        self._compiled: dict[ForwardFn, ForwardFn] = {}
        self._shapes: set[tuple[int, ...]] = set()

    @property
    def active(self) -> bool:
        return self.error is None

    def forward(self, forward: ForwardFn) -> ForwardFn:
        """The compiled `forward`, or `forward` itself once compiling has failed."""
        if not self.active:
            return forward
        if forward not in self._compiled:
            self._compiled[forward] = torch.compile(
                forward, backend=self.backend, dynamic=self.dynamic, options=self.options
            )
        return self._compiled[forward]

    def compiles(self, shape: tuple[int, ...]) -> bool:
        """Whether a chunk of step inputs of `shape` will compile (the caller times that chunk): the first
        chunk, and with static shapes every chunk of a new shape."""
        new = not self._shapes if self.dynamic else shape not in self._shapes
        self._shapes.add(shape)
        if new and self.active and self.on_compiling is not None:
            self.on_compiling()
        return new and self.active

    def compiled(self, seconds: float) -> None:
        self.compile_seconds += seconds
        self._emit("compiled", seconds=round(seconds, 3), backend=self.backend)

    def failed(self, exc: BaseException) -> None:
        self.error = f"{type(exc).__name__}: {exc}"[:500]
        self._emit("compile_failed", error=self.error)
