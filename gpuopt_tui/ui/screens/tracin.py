"""The TracIn influence screen."""

from __future__ import annotations

from gpuopt_tui.ui.screens.kind import KindScreen
from gpuopt_tui.ui.widgets.tracin_view import TracInResultsView


class TracInScreen(KindScreen):
    SCREEN_NAME = "tracin"
    KIND = "tracin"
    RESULTS = TracInResultsView
