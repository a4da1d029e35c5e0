"""What every top-level screen has: the navigation bar, a body, the footer, and the latest runs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from textual.app import ComposeResult
from textual.events import ScreenResume
from textual.screen import Screen

from gpuopt_tui.ui.run_poller import RunsSnapshot
from gpuopt_tui.ui.widgets.app_footer import AppFooter
from gpuopt_tui.ui.widgets.nav_bar import NavBar

if TYPE_CHECKING:
    from gpuopt_tui.app import GpuOptApp


class AppScreen(Screen[None]):
    """Subclasses set SCREEN_NAME, implement `compose_body`, and may override `runs_updated`."""

    SCREEN_NAME: ClassVar[str] = ""
    ALLOW_IN_MAXIMIZED_VIEW: ClassVar[str | None] = "AppFooter"  # the keys stay shown under a maximized view
    _styled_for: object = None  # what the app's styles depended on when this screen was last styled
    _held: tuple[tuple[str, dict[str, Any]], ...] = ()  # notifications held until the screen is first shown

    @property
    def nav_name(self) -> str:
        """The screen the navigation bar shows as the current one."""
        return self.SCREEN_NAME

    @property
    def gapp(self) -> GpuOptApp:
        return self.app  # type: ignore[return-value]

    def unsaved_edits(self) -> str:
        """What quitting now would lose (e.g. "the edits to profile demo-attribution"), "" for nothing."""
        return ""

    def compose(self) -> ComposeResult:
        yield NavBar(self.nav_name)
        yield from self.compose_body()
        yield AppFooter()

    def compose_body(self) -> ComposeResult:
        yield from ()

    def _style_inputs(self) -> object:
        app = self.app
        return app.theme, app.ansi_color, app.app_focus

    def on_mount(self) -> None:
        # After the app's first frame, widgets are styled as they mount with the app's final styles: showing the
        # screen need not restyle them unless something they depend on changes before. (The first screen is
        # restyled when first shown: the app's theme is applied then.)
        if self.gapp.startup_seconds is not None:
            self._styled_for = self._style_inputs()

    def on_screen_resume(self, event: ScreenResume) -> None:
        # Textual restyles every widget of a screen each time it is shown (most of a later visit's time), in case
        # something its styles depend on changed meanwhile; here only when one of those changed since the screen
        # was last styled. (A change of CSS, e.g. of the theme, is also applied by Textual itself when the screen is
        # shown.)
        styled_for = self._style_inputs()
        if styled_for == self._styled_for:
            event.refresh_styles = False
        self._styled_for = styled_for
        for message, options in self._held:
            self.app.notify(message, **options)
        self._held = ()
        # hidden screens are not redrawn on each poll; catch up when shown again
        self.runs_updated(self.gapp.runs)

    def notify_shown(self, message: str, **options: Any) -> None:
        """`app.notify`, held until the screen is first shown if it is not yet (one built in the background, see
        ui/warmup.py): a message about a screen the user has not opened would come without what it is about."""
        if self.stack_updates:
            self.app.notify(message, **options)
        else:
            self._held += ((message, options),)

    def runs_updated(self, snapshot: RunsSnapshot) -> None:
        """Called with the latest runs whenever they change while this screen is shown."""
