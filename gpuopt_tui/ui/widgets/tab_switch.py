"""Panes shown one at a time under a line of their titles: a light stand-in for TabbedContent.

A TabbedContent of two panes mounts twelve widgets (tabs, their bar and underline, a switcher, a pane around each
view) and restyles them as they mount: 40-50 ms of the planner screen's first showing on a small machine. This is
the panes, one widget for the titles and one around them all. Its look is in app.tcss.
"""

from __future__ import annotations

from typing import ClassVar

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.content import Content
from textual.widget import Widget

GAP = 2  # cells between two titles


class TabTitles(Widget, can_focus=True):
    """The titles of a TabSwitch's panes, the shown one marked; a click on one, or left/right, shows another."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("left", "move(-1)", "Previous tab", show=False),
        Binding("right", "move(1)", "Next tab", show=False),
    ]

    def __init__(self, switch: TabSwitch) -> None:
        super().__init__()
        self.switch = switch

    def render(self) -> Content:
        parts = []
        for pane, title in self.switch.titles.items():
            style = "bold $accent underline" if pane == self.switch.active else "$text-muted"
            parts.append(Content.styled(f" {title} ", style))
        return Content(" " * GAP).join(parts)

    def _pane_at(self, x: int) -> str | None:
        start = 0
        for pane, title in self.switch.titles.items():
            end = start + len(title) + 2
            if start <= x < end:
                return pane
            start = end + GAP
        return None

    def on_click(self, event: events.Click) -> None:
        pane = self._pane_at(event.x)
        if pane is not None:
            self.switch.active = pane

    def action_move(self, step: int) -> None:
        panes = list(self.switch.titles)
        self.switch.active = panes[(panes.index(self.switch.active) + step) % len(panes)]


class TabSwitch(Vertical):
    """`panes`: (title, widget with an id) pairs; the first is shown until `active` (a pane's id) is set."""

    def __init__(self, *panes: tuple[str, Widget], id: str | None = None) -> None:
        super().__init__(id=id)
        self.titles = {str(pane.id): title for title, pane in panes}
        self._panes = [pane for _, pane in panes]
        self._active = str(self._panes[0].id)

    def compose(self) -> ComposeResult:
        yield TabTitles(self)
        for pane in self._panes:
            pane.display = pane.id == self._active
            yield pane

    @property
    def active(self) -> str:
        return self._active

    @active.setter
    def active(self, pane: str) -> None:
        if pane not in self.titles:
            raise ValueError(f"no pane {pane!r} in #{self.id}")
        self._active = pane
        for widget in self._panes:
            widget.display = widget.id == pane
        if self.is_mounted:
            self.query_one(TabTitles).refresh()
