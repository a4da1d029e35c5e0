"""The footer of every screen: the keys that work where the focus is, as one line of text.

Textual's footer mounts, styles and lays out a widget per key, and does it again each time its screen is shown or
the focus moves: some tens of milliseconds per screen. This one is a single widget that draws the same keys in the
same look, repaints only when they changed, and maps a click or the mouse pointer to the key under it.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

from textual import events
from textual.binding import Binding
from textual.content import Content
from textual.screen import Screen
from textual.style import Style
from textual.widget import Widget


class FooterKey(NamedTuple):
    key: str  # the key pressed when it is clicked
    display: str  # how the key is shown, e.g. ^r
    description: str
    enabled: bool  # a key whose action cannot run now is shown dimmed
    tooltip: str


class DrawnKey(NamedTuple):
    start: int  # the cells [start, end) of the line
    end: int
    key: FooterKey


class AppFooter(Widget, can_focus=False):
    """The keys of the focused widget, its screen and the app that are shown (`Binding.show`), one per action,
    key then description, as Textual's footer shows them; the command palette's key at the right. Keys that do not
    fit are cut at the terminal's width."""

    ALLOW_SELECT = False
    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "app-footer--key",
        "app-footer--description",
        "app-footer--hover",
        "app-footer--separator",
    }
    DEFAULT_CSS = """
    AppFooter {
        dock: bottom;
        height: 1;
        color: $footer-foreground;
        background: $footer-background;
        text-wrap: nowrap;
        text-overflow: clip;
        pointer: pointer;
        .app-footer--key {
            color: $footer-key-foreground;
            background: $footer-key-background;
            text-style: bold;
        }
        .app-footer--description {
            color: $footer-description-foreground;
            background: $footer-description-background;
        }
        .app-footer--hover {
            background: $block-hover-background;
        }
        .app-footer--separator {
            color: $foreground 20%;
        }
    }
    """

    def __init__(self) -> None:
        super().__init__()
        self._keys: tuple[FooterKey, ...] = ()
        self._palette: FooterKey | None = None
        self._drawn: list[DrawnKey] = []
        self._hovered: FooterKey | None = None

    @property
    def keys(self) -> tuple[FooterKey, ...]:
        """The keys shown, the command palette's last."""
        return self._keys + ((self._palette,) if self._palette else ())

    def on_mount(self) -> None:
        # the keys are read when the screen says its bindings changed, as it does when it is shown: its widgets'
        # `check_action` may need widgets that are not mounted yet now
        self.screen.bindings_updated_signal.subscribe(self, self._bindings_changed)

    def on_unmount(self) -> None:
        self.screen.bindings_updated_signal.unsubscribe(self)

    def _bindings_changed(self, screen: Screen[object]) -> None:
        # As Textual's footer: not while the app has lost the terminal's focus (the focused widget is blurred
        # then, which would show the app's keys only), and after the refresh under way (the focus may be moving).
        if screen.app.app_focus and self.is_attached and screen is self.screen:
            self.call_after_refresh(self._update)

    def _update(self) -> None:
        if not self.is_attached:
            return
        keys, palette = self._shown_keys()
        if (keys, palette) != (self._keys, self._palette):
            self._keys, self._palette = keys, palette
            self.refresh()

    def _shown_keys(self) -> tuple[tuple[FooterKey, ...], FooterKey | None]:
        active = self.screen.active_bindings
        by_action: dict[str, FooterKey] = {}
        for _, binding, enabled, tooltip in active.values():
            if binding.show and binding.action not in by_action:
                by_action[binding.action] = self._footer_key(binding, enabled, tooltip)
        palette = None
        if self.app.ENABLE_COMMAND_PALETTE and (found := active.get(self.app.COMMAND_PALETTE_BINDING)):
            binding, enabled = found.binding, found.enabled
            palette = self._footer_key(binding, enabled, binding.tooltip or binding.description)
        return tuple(by_action.values()), palette

    def _footer_key(self, binding: Binding, enabled: bool, tooltip: str) -> FooterKey:
        return FooterKey(binding.key, self.app.get_key_display(binding), binding.description, enabled, tooltip)

    # -- drawing ------------------------------------------------------------------------------------------------

    def render(self) -> Content:
        width = self.size.width
        # partial: over the footer's own style, which a hovered key's background then shows through
        styles = (
            self.get_visual_style("app-footer--key", partial=True),
            self.get_visual_style("app-footer--description", partial=True),
        )
        line, self._drawn = Content(), []
        for key in self._keys:
            line = self._draw(line, key, self._item(key, *styles, padded=True))
        if self._palette is None:
            return line
        # at the right, after a thin rule, with the compact look Textual gives it
        palette = Content.assemble(("▏", self.get_visual_style("app-footer--separator", partial=True)))
        palette += self._item(self._palette, *styles, padded=False) + " "
        room = max(0, width - palette.cell_length)
        line = line.truncate(room, pad=True)
        self._drawn = [drawn._replace(end=min(drawn.end, room)) for drawn in self._drawn if drawn.start < room]
        return self._draw(line, self._palette, palette)

    def _item(self, key: FooterKey, key_style: Style, description_style: Style, padded: bool) -> Content:
        if not key.description:
            return Content.styled(key.display, key_style)
        if padded:
            return Content.assemble((f" {key.display} ", key_style), (f"{key.description} ", description_style))
        return Content.assemble((key.display, key_style), (f" {key.description}", description_style))

    def _draw(self, line: Content, key: FooterKey, item: Content) -> Content:
        """`line` with `item` (the key drawn) after it, dimmed or highlighted as the key is."""
        if not key.enabled:
            item = item.stylize("dim")
        if key == self._hovered:
            item = item.stylize_before(self.get_visual_style("app-footer--hover", partial=True))
        self._drawn.append(DrawnKey(line.cell_length, line.cell_length + item.cell_length, key))
        return line + item

    # -- mouse --------------------------------------------------------------------------------------------------

    def _key_at(self, x: int) -> FooterKey | None:
        return next((drawn.key for drawn in self._drawn if drawn.start <= x < drawn.end), None)

    def on_mouse_down(self, event: events.MouseDown) -> None:
        key = self._key_at(event.x)
        if key is None:
            return
        if key.enabled:
            self.app.simulate_key(key.key)  # as if it were pressed: the binding that has it where the focus is
        else:
            self.app.bell()

    def on_mouse_move(self, event: events.MouseMove) -> None:
        self._hover(self._key_at(event.x))

    def on_leave(self, event: events.Leave) -> None:
        self._hover(None)

    def _hover(self, key: FooterKey | None) -> None:
        if key != self._hovered:
            self._hovered = key
            self.tooltip = key.tooltip if key and key.tooltip else None
            self.refresh()
