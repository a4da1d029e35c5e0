"""The top line: every screen with its key; the current one highlighted; click to switch."""

from __future__ import annotations

from textual.binding import Binding
from textual.events import Resize
from textual.widgets import Static

from gpuopt_tui.ui.screens.registry import SCREENS

NARROW_BELOW = 100  # columns under which short labels are used


class NavBar(Static):
    def __init__(self, active: str) -> None:
        super().__init__(classes="nav-bar")
        self._active = active

    def on_mount(self) -> None:
        self._draw(self.app.size.width)

    def set_active(self, active: str) -> None:
        """Highlight the screen `active` as the current one."""
        if active != self._active:
            self._active = active
            if self.is_mounted:
                self._draw(self.app.size.width)

    def on_resize(self, event: Resize) -> None:
        self._draw(event.size.width)

    def _draw(self, width: int) -> None:
        narrow = width < NARROW_BELOW
        items = [] if narrow else ["[b]gpuopt-tui[/] "]
        for screen in SCREENS:
            key = self.app.get_key_display(Binding(screen.key, ""))
            item = f" [$accent]{key}[/] {screen.short if narrow else screen.label} "
            if screen.name == self._active:
                item = f"[reverse b]{item}[/]"
            items.append(f"[@click=app.show('{screen.name}')]{item}[/]")
        markup = "".join(items)
        if markup != self.content:  # a resize that keeps the labels (the first one, after the screen's first paint)
            self.update(markup)
