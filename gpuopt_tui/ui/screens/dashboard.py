"""The dashboard: the GPU panel and the runs, newest first."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import DataTable, Static

from gpuopt_tui.ui.gpu_telemetry import create_gpu_panel
from gpuopt_tui.ui.run_poller import RunsSnapshot
from gpuopt_tui.ui.screens.base import AppScreen
from gpuopt_tui.ui.widgets.runs_table import BRIEF_COLUMNS, RunsTable

START_HINT = "Open a profile with a, t, b or p and run it with ctrl+r, or pick one from the command palette (ctrl+p)."


class DashboardScreen(AppScreen):
    SCREEN_NAME = "dashboard"

    def compose_body(self) -> ComposeResult:
        with Vertical(id="gpu-slot"):
            yield create_gpu_panel(self.gapp)
        yield Static("Runs", classes="pane-title")
        yield RunsTable(BRIEF_COLUMNS, id="dashboard-runs")
        yield Static("", id="dashboard-hint")

    def runs_updated(self, snapshot: RunsSnapshot) -> None:
        self.query_one(RunsTable).update_runs(snapshot.runs)
        hint = self.query_one("#dashboard-hint", Static)
        if snapshot.error:
            hint.update(Content.from_markup("[$error]$error[/]", error=snapshot.error))
        elif not snapshot.runs:
            hint.update(Content.from_markup("No runs yet in $root. $hint", root=str(snapshot.root), hint=START_HINT))
        else:
            hint.update("enter: the run's results · click: the run in Runs · r: all runs with cancel, resume and logs")

    @on(RunsTable.Open)
    def _open_results(self, event: RunsTable.Open) -> None:
        self.gapp.open_results(event.run_id)

    @on(DataTable.RowSelected, "#dashboard-runs")
    def _open_run(self, event: DataTable.RowSelected) -> None:
        self.gapp.show_run(str(event.row_key.value))
