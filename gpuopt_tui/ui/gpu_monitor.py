"""`gpuopt-tui gpu`: the GPU view on its own, a light monitor to keep open next to a job (the app's GPU screen,
under its navigation bar, is `ui/screens/gpu.py`)."""

from __future__ import annotations

from typing import ClassVar

from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.screen import Screen

from gpuopt_tui.core.telemetry.backend import TelemetrySource
from gpuopt_tui.ui.partial_updates import crop_partial_updates
from gpuopt_tui.ui.widgets.app_footer import AppFooter
from gpuopt_tui.ui.widgets.gpu_view import GpuView


class GpuMonitorScreen(Screen):
    """The GPU view as a screen of its own, with a footer; Escape closes it when it was pushed."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "close", "Back", id="gpu.close")]

    def __init__(self, view: GpuView) -> None:
        super().__init__()
        crop_partial_updates(self)
        self.view = view

    def compose(self) -> ComposeResult:
        yield self.view
        yield AppFooter()

    def on_screen_resume(self) -> None:
        self.view.wake()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "close":
            return len(self.app.screen_stack) > 1 and self.app.screen is self
        return True

    def action_close(self) -> None:
        self.dismiss()


class GpuMonitorApp(App):
    """The GPU monitor app: `GpuMonitorScreen` alone."""

    TITLE = "gpuopt-tui gpu"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("q", "quit", "Quit", id="app.quit")]

    def __init__(self, source: TelemetrySource, interval: float = 1.0, readonly: bool = False) -> None:
        super().__init__()
        self.source = source
        self.interval = interval
        self.readonly = readonly

    def get_default_screen(self) -> Screen:
        return GpuMonitorScreen(GpuView(self.source, self.interval, readonly=self.readonly))

    def on_gpu_view_run_requested(self, message: GpuView.RunRequested) -> None:
        self.notify(f"Process of run {message.run_id}: open it with `gpuopt-tui show {message.run_id}`")

    def on_unmount(self) -> None:
        self.source.close()
