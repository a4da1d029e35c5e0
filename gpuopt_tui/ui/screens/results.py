"""One run's results on the whole screen, in the view of its kind (the same views the kind screens show for
their latest run), for any run: opened with enter from the Runs screen or the dashboard, closed with escape.
`f` lists the run's files and opens one in $PAGER (or $EDITOR with `e`)."""

from __future__ import annotations

import importlib
import os
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import DataTable, Input, Static, Tabs

from gpuopt_tui.core.format import human_time
from gpuopt_tui.core.kinds import KINDS
from gpuopt_tui.core.runs import RunInfo
from gpuopt_tui.ui.external import open_file
from gpuopt_tui.ui.run_poller import RunsSnapshot
from gpuopt_tui.ui.screens.base import AppScreen
from gpuopt_tui.ui.screens.registry import spec
from gpuopt_tui.ui.widgets.file_picker import FilePicker, Picked
from gpuopt_tui.ui.widgets.run_progress import RunProgress
from gpuopt_tui.ui.widgets.run_results import RunResults
from gpuopt_tui.ui.widgets.tab_switch import TabTitles


def results_view(kind: str) -> type[RunResults]:
    """The results view of a run kind: its kind screen's (BROWSE_RESULTS, else RESULTS), or the plain one."""
    run_kind = KINDS.get(kind)
    if run_kind is None:
        return RunResults
    screen_spec = spec(run_kind.screen)
    screen = getattr(importlib.import_module(screen_spec.module), screen_spec.factory)
    return screen.BROWSE_RESULTS or screen.RESULTS


class ResultsScreen(AppScreen):
    """The results of the run `run_id`, kept up to date while it goes on; the navigation bar shows `nav` (the
    screen it was opened from) as the current screen."""

    AUTO_FOCUS = None  # the app's: the first widget that takes the focus, so that the view's keys work at once
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Back", id="results.back", tooltip="Back to the list of runs"),
        Binding("f", "files", "Open file", id="results.files", tooltip="Open one of the run's files in $PAGER"),
        # the view's tabs switch without tabbing to them first, unless the focused widget uses the arrows itself
        # (check_action): a text field, a tab bar, a table wider than its pane
        Binding("left", "switch_tab(-1)", "Previous tab", show=False, priority=True, tooltip="The view's previous tab"),
        Binding("right", "switch_tab(1)", "Next tab", show=False, priority=True, tooltip="The view's next tab"),
    ]
    DEFAULT_CSS = """
    ResultsScreen #results-frame { height: 1fr; padding: 0 1; }
    ResultsScreen #results-head { height: auto; color: $text-muted; }
    ResultsScreen #results-progress { height: auto; max-height: 4; }
    ResultsScreen #browse-results { height: 1fr; }
    """

    def __init__(self, info: RunInfo, nav: str) -> None:
        super().__init__()
        self.info: RunInfo | None = info
        self.run_id = info.id
        self._nav = nav

    @property
    def nav_name(self) -> str:
        return self._nav

    def compose_body(self) -> ComposeResult:
        with Vertical(id="results-frame"):
            yield Static("", id="results-head")
            yield RunProgress("", gpu=self.gapp.gpu_telemetry().source, id="results-progress")
            view = results_view(self.info.kind if self.info else "")(id="browse-results")
            view.in_browser = True
            yield view

    @property
    def view(self) -> RunResults:
        return self.query_one("#browse-results", RunResults)

    def on_mount(self) -> None:
        self._show(self.info)

    def runs_updated(self, snapshot: RunsSnapshot) -> None:
        info = snapshot.get(self.run_id)
        if info != self.info:
            self._show(info)

    def _show(self, info: RunInfo | None) -> None:
        self.info = info
        head = self.query_one("#results-head", Static)
        if info is None:
            head.update(Content.from_markup("[$error]run $id no longer exists: escape goes back[/]", id=self.run_id))
        else:
            head.update(f"{info.kind} · {info.name} · created {human_time(info.created)} · {info.dir}")
        self.query_one("#results-progress", RunProgress).show(info)
        self.view.show(info)
        self.refresh_bindings()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "files":
            return self.info is not None
        if action == "switch_tab":
            focused = self.focused
            own_arrows = isinstance(focused, (Input, Tabs, TabTitles)) or (
                isinstance(focused, DataTable) and focused.max_scroll_x > 0
            )
            return not own_arrows
        return True

    def action_switch_tab(self, step: int) -> None:
        """Show the previous or next tab of the view's first tab bar (a view without tabs: nothing)."""
        bars = self.view.query(Tabs)
        if bars:
            tabs = bars.first(Tabs)
            if step > 0:
                tabs.action_next_tab()
            else:
                tabs.action_previous_tab()
        elif titles := self.view.query(TabTitles):
            titles.first(TabTitles).action_move(step)

    def action_close(self) -> None:
        self.dismiss()

    def action_files(self) -> None:
        if self.info is not None:
            self.app.push_screen(FilePicker(self.info.id, self.info.dir), self._picked)

    def _picked(self, picked: Picked | None) -> None:
        if picked is not None:
            open_file(self.app, picked.path, picked.role, dict(os.environ))
