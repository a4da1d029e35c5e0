"""The Integrated Gradients attribution screen."""

from __future__ import annotations

from gpuopt_tui.ui.screens.kind import KindScreen


class AttributionScreen(KindScreen):
    SCREEN_NAME = "attribution"
    KIND = "attribution"
