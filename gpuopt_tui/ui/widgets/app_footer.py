"""The footer of every screen: the keys that work where the focus is, as one line of text.

Textual's footer mounts, styles and lays out a widget per key, and does it again each time its screen is shown or
the focus moves: some tens of milliseconds per screen. This one is a single widget that draws the same keys in the
same look, repaints only when they changed, and maps a click or the mouse pointer to the key under it.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

from rich.cells import cell_len
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
    row: int  # the footer's line
    start: int  # the cells [start, end) of the line
    end: int
    key: FooterKey


class AppFooter(Widget, can_focus=False):
    """The keys of the focused widget, its screen and the app that are shown (`Binding.show`), one per action,
    key then description, as Textual's footer shows them; the command palette's key at the right. Where they do not
    fit on a line they are drawn closer, then on more lines: none is hidden."""

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
        height: 1;  /* more where the keys need more lines: _fit_height */
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
            self._fit_height()
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

    def _layout(self, width: int) -> tuple[bool, list[list[FooterKey]]]:
        """Whether the keys are padded, and the keys of each line: one padded line as Textual's footer draws it
        where that fits, else one compact line, else as many padded lines as the keys need (none is hidden); the
        command palette's key takes the right of the first line."""
        room = width - (_cells(self._palette, padded=False) + 2 if self._palette else 0)  # "▏" and a space
        for padded in (True, False):
            if sum(_cells(key, padded) for key in self._keys) <= room:
                return padded, [list(self._keys)]
        lines: list[list[FooterKey]] = [[]]
        used = 0
        for key in self._keys:
            cells = _cells(key, padded=True)
            if lines[-1] and used + cells > (room if len(lines) == 1 else width):
                lines.append([])
                used = 0
            lines[-1].append(key)
            used += cells
        return True, lines

    def _fit_height(self) -> None:
        lines = len(self._layout(self.size.width)[1]) if self.size.width else 1
        if self.styles.height is None or self.styles.height.value != lines:
            self.styles.height = lines

    def on_resize(self) -> None:
        self._fit_height()

    def render(self) -> Content:
        width = self.size.width
        # partial: over the footer's own style, which a hovered key's background then shows through
        styles = (
            self.get_visual_style("app-footer--key", partial=True),
            self.get_visual_style("app-footer--description", partial=True),
        )
        padded, layout = self._layout(width)
        self._drawn = []
        lines = []
        for row, keys in enumerate(layout):
            line = Content()
            for key in keys:
                line = self._draw(line, row, key, self._item(key, *styles, padded=padded, lead=True))
            lines.append(line)
        if self._palette is not None:
            # at the right, after a thin rule, with the compact look Textual gives it
            palette = Content.assemble(("▏", self.get_visual_style("app-footer--separator", partial=True)))
            palette += self._item(self._palette, *styles, padded=False, lead=False) + " "
            room = max(0, width - palette.cell_length)
            lines[0] = self._draw(lines[0].truncate(room, pad=True), 0, self._palette, palette)
        return Content("\n").join(lines)

    def _item(self, key: FooterKey, key_style: Style, description_style: Style, padded: bool, lead: bool) -> Content:
        space = " " if lead else ""
        if not key.description:
            return Content.assemble(space, (key.display, key_style))
        if padded:
            return Content.assemble((f" {key.display} ", key_style), (f"{key.description} ", description_style))
        return Content.assemble(space, (key.display, key_style), (f" {key.description}", description_style))

    def _draw(self, line: Content, row: int, key: FooterKey, item: Content) -> Content:
        """`line` with `item` (the key drawn) after it, dimmed or highlighted as the key is."""
        if not key.enabled:
            item = item.stylize("dim")
        if key == self._hovered:
            item = item.stylize_before(self.get_visual_style("app-footer--hover", partial=True))
        self._drawn.append(DrawnKey(row, line.cell_length, line.cell_length + item.cell_length, key))
        return line + item

    # -- mouse --------------------------------------------------------------------------------------------------

    def _key_at(self, x: int, y: int) -> FooterKey | None:
        return next((d.key for d in self._drawn if d.row == y and d.start <= x < d.end), None)

    def on_mouse_down(self, event: events.MouseDown) -> None:
        key = self._key_at(event.x, event.y)
        if key is None:
            return
        if key.enabled:
            self.app.simulate_key(key.key)  # as if it were pressed: the binding that has it where the focus is
        else:
            self.app.bell()

    def on_mouse_move(self, event: events.MouseMove) -> None:
        self._hover(self._key_at(event.x, event.y))

    def on_leave(self, event: events.Leave) -> None:
        self._hover(None)

    def _hover(self, key: FooterKey | None) -> None:
        if key != self._hovered:
            self._hovered = key
            self.tooltip = key.tooltip if key and key.tooltip else None
            self.refresh()


def _cells(key: FooterKey, padded: bool) -> int:
    """The cells `key` takes in a line: " ^r Run " padded, " ^r Run" compact."""
    if not key.description:
        return cell_len(key.display) + 1
    return cell_len(key.display) + cell_len(key.description) + (3 if padded else 2)
