"""The tail of a run's log.txt: a pane and a full-screen viewer that follows a running job."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Log, Static

from gpuopt_tui.core.runs.files import log_tail
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.ui.widgets.app_footer import AppFooter

FOLLOW_INTERVAL_S = 1.0


class LogView(Log):
    """Shows the last `lines` lines of a run's log; re-reads the file only when it changed."""

    def __init__(self, lines: int = 200, *, id: str | None = None) -> None:
        super().__init__(highlight=False, auto_scroll=True, id=id)
        self._tail_lines = lines
        self._seen: tuple[Path, int, int] | None = None

    def show(self, run_dir: Path | None) -> None:
        if run_dir is None:
            self._seen = None
            self.clear()
            return
        try:
            stat = RunDir(run_dir).log.stat()
            seen = (run_dir, stat.st_size, stat.st_mtime_ns)
        except OSError:
            seen = (run_dir, -1, -1)
        if seen == self._seen:
            return
        self._seen = seen
        self.clear()
        lines = log_tail(run_dir, self._tail_lines) if seen[1] >= 0 else []
        self.write_lines(lines or ["(the log is empty or does not exist)"])


class LogScreen(ModalScreen[None]):
    """The run's log, refreshed every second while it is open."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q,l", "dismiss(None)", "Close", id="log.close"),
    ]

    def __init__(self, run_id: str, run_dir: Path) -> None:
        super().__init__(classes="log-screen")
        self._run_id = run_id
        self._run_dir = run_dir

    def compose(self) -> ComposeResult:
        with Vertical(classes="log-frame"):
            yield Static(
                Content.from_markup("[b]log of $id[/]  $path", id=self._run_id, path=str(RunDir(self._run_dir).log)),
                classes="pane-title",
            )
            yield LogView(lines=2000, id="log-full")
        yield AppFooter()

    def on_mount(self) -> None:
        self._follow()
        self.set_interval(FOLLOW_INTERVAL_S, self._follow, name="log follow")

    def _follow(self) -> None:
        self.query_one(LogView).show(self._run_dir)
