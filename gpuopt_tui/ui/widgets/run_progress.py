"""Live progress of one run: status, a progress bar, rate, ETA and the run's own GPU memory figures."""

from __future__ import annotations

import time

from textual.content import Content
from textual.events import Resize
from textual.widgets import Static

from gpuopt_tui.core.format import human_duration
from gpuopt_tui.core.runs import RunInfo
from gpuopt_tui.ui.widgets.run_text import bar, eta_text, memory_text, rate_text, status_content

BAR_MIN = 10


class RunProgress(Static):
    """Renders a RunInfo; `show(None)` renders `empty_text`."""

    def __init__(self, empty_text: str = "No run yet.", *, id: str | None = None) -> None:
        super().__init__(id=id, markup=False)
        self._empty_text = empty_text
        self._info: RunInfo | None = None

    def show(self, info: RunInfo | None) -> None:
        self._info = info
        self.update(self._render_info())

    def on_resize(self, event: Resize) -> None:
        self.update(self._render_info())

    def _render_info(self) -> Content:
        info = self._info
        if info is None:
            return Content(self._empty_text)
        lines = [
            Content.assemble(
                Content.from_markup("[b]$id[/]  ", id=info.id),
                status_content(info.status),
                f"  attempt {info.attempt}" if info.attempt > 1 else "",
            )
        ]
        progress = info.progress
        if progress:
            width = max(BAR_MIN, self.size.width - 24)
            fraction = info.fraction
            pct = f" {fraction:4.0%}" if fraction is not None else ""
            count = f"{progress.get('done')}/{progress.get('total')} {progress.get('unit') or ''}".rstrip()
            lines.append(Content(f"{bar(fraction, width)}{pct} {count}"))
            details = [f"rate {rate_text(progress)}"]
            if info.active:
                details.append(f"ETA {eta_text(info) or '--'}")
            details.append(f"elapsed {human_duration(self._elapsed(info))}")
            if progress.get("stage"):
                details.append(f"stage {progress['stage']}")
            lines.append(Content(" · ".join(details)))
            memory = memory_text(progress)
            lines.append(Content(f"GPU memory (torch): {memory}" if memory else "GPU memory: not reported by this run"))
        elif info.active:
            lines.append(Content("waiting for the first progress report…"))
        if info.message:
            style = "$error" if info.status in ("failed", "crashed", "missing") else "$text-muted"
            lines.append(Content.from_markup(f"[{style}]$message[/]", message=info.message))
        if info.corrupt_lines:
            lines.append(
                Content.from_markup(
                    "[$warning]$n unreadable line(s) in events.jsonl were skipped[/]", n=str(info.corrupt_lines)
                )
            )
        return Content("\n").join(lines)

    @staticmethod
    def _elapsed(info: RunInfo) -> float:
        end = info.ended if info.ended is not None and not info.active else time.time()
        return max(0.0, end - info.created)
