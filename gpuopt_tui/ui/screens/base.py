"""What every top-level screen has: the navigation bar, a body, the footer, and the latest runs."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import Footer

from gpuopt_tui.ui.run_poller import RunsSnapshot
from gpuopt_tui.ui.widgets.nav_bar import NavBar

if TYPE_CHECKING:
    from gpuopt_tui.app import GpuOptApp


class AppScreen(Screen[None]):
    """Subclasses set SCREEN_NAME, implement `compose_body`, and may override `runs_updated`."""

    SCREEN_NAME: ClassVar[str] = ""

    @property
    def nav_name(self) -> str:
        """The screen the navigation bar shows as the current one."""
        return self.SCREEN_NAME

    @property
    def gapp(self) -> GpuOptApp:
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        yield NavBar(self.nav_name)
        yield from self.compose_body()
        yield Footer()

    def compose_body(self) -> ComposeResult:
        yield from ()

    def on_screen_resume(self) -> None:
        # hidden screens are not redrawn on each poll; catch up when shown again
        self.runs_updated(self.gapp.runs)

    def runs_updated(self, snapshot: RunsSnapshot) -> None:
        """Called with the latest runs whenever they change while this screen is shown."""
