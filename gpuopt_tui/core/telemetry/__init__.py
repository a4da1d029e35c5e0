"""GPU telemetry: NVML samples, recorded traces, history, and the sources the UI and CLI poll.

Pure Python (no torch, no Textual). `open_source()` picks live NVML, a replayed trace, or the no-GPU state.
"""

from gpuopt_tui.core.telemetry.backend import (
    CachedRunLookup,
    NoGpuSource,
    NvmlSource,
    ReplaySource,
    RunLookup,
    TelemetrySource,
    open_source,
)
from gpuopt_tui.core.telemetry.fields import GpuSample
from gpuopt_tui.core.telemetry.history import MIN_INTERVAL_S, History
from gpuopt_tui.core.telemetry.replay import Trace, TraceWriter, read_trace, replay
from gpuopt_tui.core.telemetry.runmem import RunMemory, run_memory
from gpuopt_tui.core.telemetry.snapshot import ProcessSample, Snapshot

__all__ = [
    "MIN_INTERVAL_S",
    "CachedRunLookup",
    "GpuSample",
    "History",
    "NoGpuSource",
    "NvmlSource",
    "ProcessSample",
    "ReplaySource",
    "RunLookup",
    "RunMemory",
    "Snapshot",
    "TelemetrySource",
    "Trace",
    "TraceWriter",
    "open_source",
    "read_trace",
    "replay",
    "run_memory",
]
