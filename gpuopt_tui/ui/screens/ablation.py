"""The Layer ablation and probing screen."""

from __future__ import annotations

from gpuopt_tui.ui.screens.kind import KindScreen


class AblationScreen(KindScreen):
    SCREEN_NAME = "ablation"
    KIND = "ablation"
