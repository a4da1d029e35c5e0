"""How a run's status and progress read on screen (shared by the runs table, progress and detail panes)."""

from __future__ import annotations

import time
from typing import Any

from textual.content import Content

from gpuopt_tui.core.format import human_bytes, human_duration
from gpuopt_tui.core.runs.status import RunInfo, stage_text
from gpuopt_tui.core.telemetry.runmem import RunMemory

STATUS_COLOR = {
    "starting": "$accent",
    "running": "$accent",
    "finished": "$success",
    "failed": "$error",
    "crashed": "$error",
    "damaged": "$error",
    "missing": "$error",
    "cancelled": "$warning",
}
RANK_STATE_COLOR = {"running": "$accent", "finished": "$success", "failed": "$error", "cancelled": "$warning"}


def status_content(status: str) -> Content:
    color = STATUS_COLOR.get(status)
    return Content.from_markup(f"[{color}]$status[/]" if color else "$status", status=status)


def first_line(message: str, width: int) -> str:
    """The first line of a message, cut to `width` characters."""
    line = message.splitlines()[0] if message else ""
    return line if len(line) <= width else line[: width - 1] + "…"


def ranks_text(info: RunInfo) -> str:
    """How many ranks a run over several processes has ("4 ranks", once they report); "" for one process."""
    count = len(info.rank_progress)
    return "" if not count else "1 rank" if count == 1 else f"{count} ranks"


def progress_text(info: RunInfo) -> str:
    """`done/total (pct)` (the stage, for a stage without a count) and, over several processes, how many; ""
    before the first report."""
    done, total = info.progress.get("done"), info.progress.get("total")
    count = stage_text(info.progress)
    if done is not None and total is not None:
        fraction = info.fraction
        pct = f" ({fraction:.0%})" if fraction is not None else ""
        count = f"{done}/{total}{pct}"
    return " · ".join(part for part in (count, ranks_text(info)) if part)


def activity_text(info: RunInfo) -> str:
    """What an active run is doing, in a line: its stage, count and rate ("check: optimized path 96/256 (38%)
    · 41 steps/s"); an ended run's progress_text."""
    count = progress_text(info)
    if not info.active or "total" not in info.progress:
        return count
    stage = stage_text(info.progress)
    return f"{stage} {count} · {rate_text(info.progress)}" if stage else f"{count} · {rate_text(info.progress)}"


def over_ranks_text(info: RunInfo) -> str:
    """How many ranks a combined progress sums: " over 4 ranks", or " over 1 of 4 ranks" (those at rank 0's stage)."""
    total = len(info.rank_progress)
    summed = info.progress.get("ranks")
    if not total or not isinstance(summed, int):
        return ""
    return f" over {summed} ranks" if summed == total else f" over {summed} of {total} ranks"


def rank_state(info: RunInfo, report: dict[str, Any]) -> str:
    """A rank's state; one still "running" after the run ended never said how it ended (torchrun stopped it
    after another rank failed, or it was killed): "stopped"."""
    state = str(report.get("state", "running"))
    return "stopped" if state == "running" and not info.active else state


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


def memory_reports(info: RunInfo) -> list[dict[str, Any]]:
    """The progress events whose torch memory figures describe the run: its own, or one per rank (while the run
    goes on, without the ranks that have ended: their memory is given back)."""
    if not info.rank_progress:
        return [info.progress]
    return [p for p in info.rank_progress.values() if not info.active or p.get("state") == "running"]


def torch_memory_text(memory: RunMemory) -> str:
    """The run's own GPU memory figures (torch allocator), summed over its ranks' GPUs when it has several;
    "" when it reports none."""
    figures = (("allocated", memory.torch_allocated), ("reserved", memory.torch_reserved), ("peak", memory.torch_peak))
    parts = [f"{label} {human_bytes(value)}" for label, value in figures if value is not None]
    if parts and memory.torch_processes > 1:
        parts.append(f"summed over {memory.torch_processes} GPUs")
    return " · ".join(parts)


def nvml_memory_text(memory: RunMemory) -> str:
    """What NVML reports for a run's processes: total, which processes on how many GPUs, and (where NVML saw
    exactly the processes that report torch figures) how much lies outside torch's reserved pools; "" when
    NVML saw none of them."""
    if not memory.pids:
        return ""
    used = human_bytes(memory.nvml_used)
    overhead = memory.overhead
    pools = "pool" if len(memory.pids) == 1 else "pools"
    beyond = "" if overhead is None else f" · {human_bytes(overhead)} outside torch's {pools}"
    indices = ",".join(str(g) for g in memory.gpus)
    if len(memory.pids) == 1:
        gpus = f"GPU{'s' if len(memory.gpus) > 1 else ''} {indices}"
        return f"{used} · pid {memory.pids[0]} on {gpus}{beyond}"
    gpus = f"GPU {indices}" if len(memory.gpus) == 1 else f"{len(memory.gpus)} GPUs ({indices})"
    return f"{used} on {gpus} · {len(memory.pids)} processes{beyond}"


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
