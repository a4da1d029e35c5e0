"""How a run's status and progress read on screen (shared by the runs table, progress and detail panes)."""

from __future__ import annotations

import time
from typing import Any

from textual.content import Content

from gpuopt_tui.core.format import human_bytes, human_duration
from gpuopt_tui.core.runs import RunInfo
from gpuopt_tui.core.telemetry.runmem import RunMemory

STATUS_COLOR = {
    "starting": "$accent",
    "running": "$accent",
    "finished": "$success",
    "failed": "$error",
    "crashed": "$error",
    "missing": "$error",
    "cancelled": "$warning",
}
MEMORY_FIELDS = (("gpu_allocated", "allocated"), ("gpu_reserved", "reserved"), ("gpu_peak", "peak"))


def status_content(status: str) -> Content:
    color = STATUS_COLOR.get(status)
    return Content.from_markup(f"[{color}]$status[/]" if color else "$status", status=status)


def progress_text(info: RunInfo) -> str:
    """`done/total unit (pct)`, or "" before the first progress event."""
    done, total = info.progress.get("done"), info.progress.get("total")
    if done is None or total is None:
        return ""
    fraction = info.fraction
    pct = f" ({fraction:.0%})" if fraction is not None else ""
    return f"{done}/{total}{pct}"


def eta_text(info: RunInfo) -> str:
    eta = info.progress.get("eta")
    return human_duration(eta) if info.active and isinstance(eta, (int, float)) else ""


def rate_text(progress: dict[str, Any]) -> str:
    rate = progress.get("rate")
    if not isinstance(rate, (int, float)):
        return "--"
    unit = str(progress.get("unit") or "items")
    digits = 0 if rate >= 100 else 1 if rate >= 10 else 2
    return f"{rate:,.{digits}f} {unit}/s"


def memory_text(progress: dict[str, Any]) -> str:
    """The run's own GPU memory figures (torch allocator, bytes) from its progress events, if it reports them."""
    parts = [f"{label} {human_bytes(progress[key])}" for key, label in MEMORY_FIELDS if progress.get(key) is not None]
    return " · ".join(parts)


def nvml_memory_text(memory: RunMemory) -> str:
    """What NVML reports for a run's processes: total, which processes on which GPUs, and (for one process on
    one GPU) how much of it lies outside torch's reserved pool; "" when NVML saw none of them."""
    if not memory.pids:
        return ""
    used = human_bytes(memory.nvml_used)
    pids = f"pid {memory.pids[0]}" if len(memory.pids) == 1 else f"{len(memory.pids)} processes"
    gpus = f"GPU{'s' if len(memory.gpus) > 1 else ''} {','.join(str(g) for g in memory.gpus)}"
    overhead = memory.overhead
    beyond = "" if overhead is None else f" · {human_bytes(overhead)} outside torch's pool"
    return f"{used} · {pids} on {gpus}{beyond}"


def elapsed_seconds(info: RunInfo, now: float | None = None) -> float:
    """Time the current attempt has run (a resumed run's downtime left out), up to its end while it is over."""
    start = info.started if info.started is not None else info.created
    end = info.ended if info.ended is not None and not info.active else (time.time() if now is None else now)
    return max(0.0, end - start)


def bar(fraction: float | None, width: int) -> str:
    """A text progress bar (no animation: cheap to redraw over SSH)."""
    if width <= 0:
        return ""
    if fraction is None:
        return "░" * width
    filled = round(fraction * width)
    return "█" * filled + "░" * (width - filled)
