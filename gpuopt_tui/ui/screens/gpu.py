"""The app's GPU screen: the GPU view (`widgets/gpu_view.py`) under the navigation bar, fed by the app's one
telemetry source and history (`ui/gpu_telemetry.py`)."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult

from gpuopt_tui.ui.partial_updates import crop_partial_updates
from gpuopt_tui.ui.screens.base import AppScreen
from gpuopt_tui.ui.widgets.gpu_view import GpuView


class GpuScreen(AppScreen):
    """The GPU view under the app's navigation bar. Enter on a process of a run opens that run."""

    SCREEN_NAME = "gpu"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        crop_partial_updates(self)

    def compose_body(self) -> ComposeResult:
        telemetry = self.gapp.gpu_telemetry()
        yield GpuView(telemetry.source, history=telemetry.history, readonly=self.gapp.readonly, id="gpu-view")

    @property
    def view(self) -> GpuView:
        return self.query_one("#gpu-view")  # type: ignore[return-value]

    def select_gpu(self, index: int) -> None:
        self.view.select(index)

    def on_screen_resume(self) -> None:
        # AppScreen's handler runs too (Textual calls the handler of every class in the MRO)
        self.view.wake()
