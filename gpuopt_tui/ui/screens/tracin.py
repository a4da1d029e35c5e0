"""The TracIn influence screen."""

from __future__ import annotations

from typing import ClassVar

from textual.binding import Binding, BindingType
from textual.widget import Widget

from gpuopt_tui.ui.screens.kind import KindScreen
from gpuopt_tui.ui.widgets.tracin_view import TracInResultsView


class TracInScreen(KindScreen):
    SCREEN_NAME = "tracin"
    KIND = "tracin"
    RESULTS = TracInResultsView

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding(
            "ctrl+o",
            "toggle_results",
            "Results",
            id="tracin.results",
            tooltip="Show the latest run's results on the whole screen (escape comes back)",
        ),
    ]

    def on_mount(self) -> None:
        super().on_mount()
        self.watch(self, "maximized", self._maximized_changed, init=False)

    def _maximized_changed(self, widget: Widget | None) -> None:
        # the results pane's top margin (from the app's stylesheet) would leave a gap on the full screen
        view = self.query_one("#run-results", TracInResultsView)
        if widget is view:
            view.styles.margin = 0
        else:
            view.styles.clear_rule("margin")

    def action_toggle_results(self) -> None:
        if self.maximized is not None:
            self.minimize()
            return
        view = self.query_one("#run-results", TracInResultsView)
        if self.maximize(view, container=False):
            view.focus_results()
