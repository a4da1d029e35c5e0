"""Where the GPU panel and the GPU screen plug in.

They come from `gpuopt_tui.ui.widgets.gpu_panel` and `gpuopt_tui.ui.screens.gpu`, fed by one telemetry source
(live NVML, or the trace given with --replay) and one history shared by the panel and the screen, so the
screen's plots go on from what the panel saw. A build without them shows one line saying so.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

from textual.app import ComposeResult
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Static

from gpuopt_tui.ui.screens.base import AppScreen

if TYPE_CHECKING:
    from gpuopt_tui.app import GpuOptApp

GPU_MISSING = "GPU telemetry not available in this build"


def _optional(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        return None


class GpuTelemetry:
    """The app's one telemetry source and history, opened on first use (NVML itself starts on the first poll)."""

    def __init__(self, app: GpuOptApp) -> None:
        from gpuopt_tui.core.telemetry.backend import CachedRunLookup, open_source
        from gpuopt_tui.core.telemetry.history import History

        self.source: Any = open_source(app.replay, run_lookup=CachedRunLookup(app.active_run_pids))
        self.history: Any = History()

    def close(self) -> None:
        self.source.close()


def create_gpu_panel(app: GpuOptApp) -> Widget:
    module = _optional("gpuopt_tui.ui.widgets.gpu_panel")
    if module is None:
        return Static(GPU_MISSING, classes="gpu-missing")
    telemetry = app.gpu_telemetry()
    return module.GpuPanel(telemetry.source, history=telemetry.history, id="gpu-panel")


def create_gpu_screen(app: GpuOptApp) -> Screen:
    module = _optional("gpuopt_tui.ui.screens.gpu")
    if module is None:
        return GpuMissingScreen()
    telemetry = app.gpu_telemetry()
    return module.GpuScreen(telemetry.source, history=telemetry.history, readonly=app.readonly)


class GpuMissingScreen(AppScreen):
    SCREEN_NAME = "gpu"

    def compose_body(self) -> ComposeResult:
        yield Static(GPU_MISSING, classes="gpu-missing")
