"""Live progress of one run: status, a progress bar, rate, ETA and the run's own GPU memory figures.

Given a live GPU source (NVML on this machine), the torch figures of the run's progress events are shown
beside what NVML reports for the run's processes; the GPUs are polled only while an active run is on screen.
A run over several processes shows its combined progress, how many ranks it has and memory summed over them.
"""

from __future__ import annotations

import time

from textual.content import Content
from textual.events import Resize
from textual.widgets import Static

from gpuopt_tui.core.format import human_duration
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.status import RunInfo, stage_text
from gpuopt_tui.core.telemetry.backend import TelemetrySource
from gpuopt_tui.core.telemetry.runmem import run_memory
from gpuopt_tui.core.telemetry.snapshot import Snapshot
from gpuopt_tui.ui.gpu_poller import GpuPoller
from gpuopt_tui.ui.widgets.run_text import (
    bar,
    elapsed_seconds,
    eta_text,
    memory_reports,
    nvml_memory_text,
    over_ranks_text,
    ranks_text,
    rate_text,
    status_content,
    torch_memory_text,
)

BAR_MIN = 10
GPU_INTERVAL_S = 2.0  # NVML polls for the run's own processes
GPU_STALE_S = 10.0  # an NVML figure older than this (the poll stopped while hidden) is not shown


class RunProgress(Static):
    """Renders a RunInfo; `show(None)` renders `empty_text`. `gpu`: the app's GPU source; used when live."""

    def __init__(
        self, empty_text: str = "No run yet.", *, gpu: TelemetrySource | None = None, id: str | None = None
    ) -> None:
        super().__init__(id=id, markup=False)
        self._empty_text = empty_text
        self._info: RunInfo | None = None
        self._gpu = gpu if gpu is not None and gpu.live else None
        self._poller: RunGpuPoller | None = None
        self._snapshot: Snapshot | None = None

    def on_unmount(self) -> None:
        if self._poller is not None:
            self._poller.remove()

    def show(self, info: RunInfo | None) -> None:
        self._info = info
        self.update(self._render_info())
        if self._gpu is not None and self.wants_gpu():
            self._wake_poller(self._gpu)

    def _wake_poller(self, gpu: TelemetrySource) -> None:
        """Poll the GPUs for the active run shown. The poller is mounted the first time there is one (and polls at
        once then); a Static cannot hold it: it goes beside this widget, in the same container."""
        if self._poller is not None:
            self._poller.wake()
        elif self.parent is not None:
            self._poller = RunGpuPoller(self, gpu)
            self.parent.mount(self._poller, after=self)

    def wants_gpu(self) -> bool:
        """Whether NVML figures of the shown run are wanted: it is active and its process is known."""
        return self._info is not None and self._info.active and bool(self._info.pid)

    def show_gpu(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot
        if self.wants_gpu():
            self.update(self._render_info())

    def on_resize(self, event: Resize) -> None:
        content = self._render_info()
        if content != self.content:  # its text, compared: a resize changes the bar's width, not the styles
            self.update(content)

    def _render_info(self) -> Content:
        info = self._info
        if info is None:
            return Content(self._empty_text)
        lines = [
            Content.assemble(
                Content.from_markup("[b]$id[/]", id=info.id),
                Content.from_markup(" · $name", name=info.name) if info.name != info.id else "",  # its profile
                "  ",
                status_content(info.status),
                f"  attempt {info.attempt}" if info.attempt > 1 else "",
            )
        ]
        progress = info.progress
        memory = run_memory(memory_reports(info), self._fresh_snapshot(), info.id, info.pids())
        if progress:
            stage = [f"stage {text}"] if (text := stage_text(progress)) else []
            elapsed = f"elapsed {human_duration(elapsed_seconds(info))}"
            if "total" in progress:
                width = max(BAR_MIN, self.size.width - 24)
                fraction = info.fraction
                pct = f" {fraction:4.0%}" if fraction is not None else ""
                count = f"{progress.get('done')}/{progress.get('total')} {progress.get('unit') or ''}".rstrip()
                lines.append(Content(f"{bar(fraction, width)}{pct} {count}"))
                eta = [f"ETA {eta_text(info) or '--'}"] if info.active else []
                details = [f"rate {rate_text(progress)}{over_ranks_text(info)}", *eta, elapsed, *stage]
            else:  # a stage without a count (loading the model): no bar, rate or ETA
                details = [*stage, elapsed]
            lines.append(Content(" · ".join(details)))
            torch = torch_memory_text(memory)
            lines.append(Content(f"GPU memory (torch): {torch}" if torch else "GPU memory: not reported by this run"))
        elif info.active:
            started = f" ({ranks} started)" if (ranks := ranks_text(info)) else ""
            lines.append(Content(f"waiting for the first progress report…{started}"))
        nvml = nvml_memory_text(memory)
        if nvml:
            lines.append(Content(f"GPU memory (NVML): {nvml}"))
        if info.message:
            style = "$error" if info.status in ("failed", "crashed", "missing") else "$text-muted"
            lines.append(Content.from_markup(f"[{style}]$message[/]", message=info.message))
        if info.corrupt_lines:
            lines.append(
                Content.from_markup(
                    "[$warning]$n unreadable line(s) in $file were skipped[/]",
                    n=str(info.corrupt_lines),
                    file=RunDir.EVENTS,
                )
            )
        return Content("\n").join(lines)

    def _fresh_snapshot(self) -> Snapshot | None:
        """The last NVML snapshot, while it is recent and describes the run on screen."""
        snapshot = self._snapshot
        if not self.wants_gpu() or snapshot is None or time.time() - snapshot.time > GPU_STALE_S:
            return None
        return snapshot


class RunGpuPoller(GpuPoller):
    """Polls the GPUs for a RunProgress while it shows an active run, and hands it each snapshot."""

    def __init__(self, progress: RunProgress, source: TelemetrySource) -> None:
        super().__init__(source, GPU_INTERVAL_S, when=progress.wants_gpu)
        self._progress = progress

    def on_gpu_poller_polled(self, message: GpuPoller.Polled) -> None:
        message.stop()  # GpuPoller's own handler still runs: it arms the next poll
        self._progress.show_gpu(message.snapshot)
