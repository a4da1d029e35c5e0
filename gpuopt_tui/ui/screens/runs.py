"""Every run: status and progress in a table, filtered (`/`) and sorted (`o` or a header); enter opens a run's
results; cancel, resume, delete; details, ranks and the log of the selected run."""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.content import Content
from textual.timer import Timer
from textual.widgets import DataTable, Input, Static

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.format import human_time
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.lifecycle import delete_run, resume_run
from gpuopt_tui.core.runs.status import RESUMABLE, RunInfo
from gpuopt_tui.ui.run_poller import RunsSnapshot
from gpuopt_tui.ui.screens.base import AppScreen
from gpuopt_tui.ui.widgets.confirm import ConfirmDialog
from gpuopt_tui.ui.widgets.log_view import LogScreen, LogView
from gpuopt_tui.ui.widgets.rank_table import RankTable
from gpuopt_tui.ui.widgets.run_progress import RunProgress
from gpuopt_tui.ui.widgets.runs_table import FULL_COLUMNS, RunsTable

RANKS_DETAIL_HEIGHT = "60%"
PREFETCH_AFTER_S = 0.1  # a run the cursor rests on this long is read ahead of its opening (ResultsOpener.prefetch)


def warm_title(ready: tuple[int, ...], kept: bool) -> str:
    """What the detail pane's border says of warm runners: those ready, or the one this app keeps, still importing."""
    if ready:
        return f"warm runner ready (pid {', '.join(map(str, ready))}): a run started now skips its imports"
    return "warm runner: importing torch and transformers" if kept else ""


class RunsScreen(AppScreen):
    SCREEN_NAME = "runs"
    AUTO_FOCUS = "#runs-table"  # not the filter field, hidden until `/`
    _prefetch_timer: Timer | None = None

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("c", "cancel", "Cancel", id="runs.cancel", tooltip="Stop the selected run (SIGTERM)"),
        Binding("s", "resume", "Resume", id="runs.resume", tooltip="Start a stopped run again from its shards"),
        Binding("x", "delete", "Delete", id="runs.delete", tooltip="Delete the run directory"),
        Binding("l", "log", "Log", id="runs.log", tooltip="Follow the run's log"),
        Binding(
            "slash",
            "filter",
            "Filter",
            id="runs.filter",
            tooltip="Show only runs whose id, kind, name or status has a text",
        ),
        Binding("o", "sort", "Sort", id="runs.sort", tooltip="Sort by the next column (or click a header)"),
    ]

    def compose_body(self) -> ComposeResult:
        runs_filter = Input(
            placeholder="filter: part of an id, kind, profile name or status", id="runs-filter", compact=True
        )
        runs_filter.display = False
        yield runs_filter
        yield RunsTable(FULL_COLUMNS, id="runs-table")
        with Vertical(id="run-detail"):
            yield RunProgress("No run selected.", gpu=self.gapp.gpu_telemetry().source, id="detail-progress")
            yield RankTable(id="detail-ranks")
            yield Static("", id="detail-info", markup=False)
            yield LogView(lines=30, id="detail-log")

    @property
    def table(self) -> RunsTable:
        return self.query_one("#runs-table", RunsTable)

    @property
    def selected(self) -> RunInfo | None:
        run_id = self.table.selected_id
        return self.gapp.runs.get(run_id) if run_id else None

    def select_run(self, run_id: str) -> None:
        self.table.select(run_id)
        self.table.focus()

    def runs_updated(self, snapshot: RunsSnapshot) -> None:
        self.table.update_runs(snapshot.runs)
        self.query_one("#run-detail").border_title = warm_title(snapshot.warm, self.gapp.warm)
        self._show_detail()

    @on(DataTable.RowHighlighted, "#runs-table")
    def _highlighted(self) -> None:
        self._show_detail()
        if self._prefetch_timer is not None:
            self._prefetch_timer.stop()
        self._prefetch_timer = self.set_timer(PREFETCH_AFTER_S, self._prefetch, name="results prefetch")

    def _prefetch(self) -> None:
        self._prefetch_timer = None
        info = self.selected
        if info is not None and self.is_current:
            self.gapp.results_opener.prefetch(info)

    @on(RunsTable.Open)
    def _open(self, event: RunsTable.Open) -> None:
        self.gapp.open_results(event.run_id)

    def action_filter(self) -> None:
        field = self.query_one("#runs-filter", Input)
        field.display = True
        field.focus()

    @on(Input.Changed, "#runs-filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.table.set_filter(event.value)
        self._show_detail()

    @on(Input.Submitted, "#runs-filter")
    def _filter_done(self) -> None:
        self.table.focus()

    def key_escape(self) -> None:
        """Escape in the filter clears it and hides it."""
        field = self.query_one("#runs-filter", Input)
        if field.has_focus or field.value:
            field.value = ""
            field.display = False
            self.table.focus()

    def action_sort(self) -> None:
        self.table.next_sort()

    def _show_detail(self) -> None:
        info = self.selected
        snapshot = self.gapp.runs
        self.query_one("#detail-progress", RunProgress).show(info)
        self.query_one("#detail-ranks", RankTable).show(info)
        # a run's ranks take room from the log's tail (l shows it whole): the detail grows while one is selected
        self.query_one("#run-detail").styles.height = RANKS_DETAIL_HEIGHT if info and info.rank_progress else None
        details = self.query_one("#detail-info", Static)
        if info is None:
            empty = snapshot.error or f"No runs yet in {snapshot.root}."
            if snapshot.runs and self.table.filter_text:
                empty = f"No run matches {self.table.filter_text!r} (escape clears the filter)."
            details.update(empty if not self.table.row_count else "")
        else:
            where = f" on {info.host}" if info.remote else ""
            details.update(
                f"{info.kind} · {info.name} · created {human_time(info.created)} · pid {info.pid or '-'}{where}\n"
                f"{info.dir}"
            )
        self.query_one("#detail-log", LogView).show(info.dir if info else None)
        self.refresh_bindings()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        info = self.selected
        if action == "cancel":
            return info is not None and (info.active or bool(info.orphans))
        if action == "resume":
            return info is not None and info.status in RESUMABLE
        if action in ("delete", "log"):
            return info is not None
        return True

    def _existing(self) -> RunInfo | None:
        """The selected run, if its directory is still there (another process may have deleted it)."""
        info = self.selected
        if info is not None and not RunDir(info.dir).meta.exists():
            self.gapp.report_error(f"run {info.id} no longer exists: {info.dir} was deleted", title="Run gone")
            self.gapp.poller.poll_now()
            return None
        return info

    def action_cancel(self) -> None:
        info = self._existing()
        if info is not None:
            self.gapp.confirm_cancel(info)

    def action_resume(self) -> None:
        info = self._existing()
        if info is None:
            return
        try:
            resume_run(info.dir)
        except UserError as e:
            self.gapp.report_error(str(e), title="Not resumed")
            return
        self.notify(f"resumed {info.id}: finished shards are kept")
        self.gapp.poller.poll_now()

    def action_delete(self) -> None:
        info = self._existing()
        if info is None:
            return

        def answered(yes: bool | None) -> None:
            if not yes:
                return
            try:
                delete_run(info.dir)
            except UserError as e:
                self.gapp.report_error(str(e), title="Not deleted")
                return
            self.notify(f"deleted {info.id}")
            self.gapp.poller.poll_now()

        question = Content.from_markup(
            "Delete run [b]$id[/] and everything in\n$dir?\nThis cannot be undone.", id=info.id, dir=str(info.dir)
        )
        self.app.push_screen(ConfirmDialog(question, "Delete", "Keep"), answered)

    def action_log(self) -> None:
        info = self._existing()
        if info is not None:
            self.app.push_screen(LogScreen(info.id, info.dir))
