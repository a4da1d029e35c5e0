"""The TracIn influence screen."""

from __future__ import annotations

from gpuopt_tui.ui.screens.kind import KindScreen


class TracInScreen(KindScreen):
    SCREEN_NAME = "tracin"
    KIND = "tracin"
