"""The app's GPU telemetry and the GPU panel it feeds.

The panel and the GPU screen (`screens/gpu.py`) are both fed by one telemetry source (live NVML, or the trace
given with --replay) and one history, so the screen's plots go on from what the panel saw.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gpuopt_tui.core.telemetry.backend import CachedRunLookup, ReplaySource, TelemetrySource, open_source
from gpuopt_tui.core.telemetry.history import History
from gpuopt_tui.core.telemetry.replay import Trace, read_trace
from gpuopt_tui.ui.widgets.gpu_panel import GpuPanel

if TYPE_CHECKING:
    from gpuopt_tui.app import GpuOptApp


@dataclass
class GpuTelemetry:
    """The app's one telemetry source and the history shared by the panel and the screen."""

    source: TelemetrySource
    history: History = field(default_factory=History)

    @classmethod
    def open(cls, replay: Path | None, active_runs: Callable[[], Mapping[int, str]]) -> GpuTelemetry:
        """Live NVML (started by the first poll, in a worker) or the trace `replay`; `active_runs` maps the
        process ids of running runs to their ids, so that their GPU processes are marked."""
        return cls(open_source(replay, run_lookup=CachedRunLookup(active_runs)))

    @classmethod
    def from_trace(
        cls, trace: Trace | Path, start: int = 0, stop: int | None = None, speed: float | None = 1.0, loop: bool = True
    ) -> GpuTelemetry:
        """A replay of samples start..stop-1 of a trace, with the samples before `start` already in the history,
        as if the panel had been watching since the trace began (screenshots and tests use it). With one
        sample left, speed None and loop False, every poll returns that sample: a still picture."""
        trace = trace if isinstance(trace, Trace) else read_trace(trace)
        history = History()
        for snapshot in trace.snapshots[:start]:
            history.add(snapshot)
        played = Trace(trace.path, trace.header, trace.snapshots[start:stop])
        return cls(ReplaySource(played, speed=speed, loop=loop), history)

    def close(self) -> None:
        self.source.close()


def busiest_sample(trace: Trace) -> int:
    """Index of the first sample where the GPUs are busiest: the most memory in use, weighted by SM
    utilisation, summed over the GPUs (screenshots and tests show a trace there)."""
    load = [sum((g.memory_used or 0) * (g.util_sm or 0) for g in s.gpus) for s in trace.snapshots]
    return load.index(max(load))


def create_gpu_panel(app: GpuOptApp) -> GpuPanel:
    telemetry = app.gpu_telemetry()
    return GpuPanel(telemetry.source, history=telemetry.history, id="gpu-panel")
