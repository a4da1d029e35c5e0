"""A one-line chooser of one value among a few: the chosen option's label and an arrow; enter, space, up, down or a
click opens the options in a small menu under it (a modal screen made when asked for).

A compact Select is six widgets (and its overlay list) that restyle themselves as they mount: about a tenth of a
profile screen's first showing for each of the screen's two choosers. This is one widget; its menu is built only
when opened. Its look is in app.tcss (a widget's own CSS makes Textual parse its stylesheets again the first time
the widget is shown).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

from rich.cells import cell_len
from textual import events, on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.content import Content
from textual.geometry import Region
from textual.message import Message
from textual.screen import ModalScreen
from textual.widget import Widget
from textual.widgets import OptionList

BLANK: Any = object()  # the value of a field with no option chosen
MENU_ROWS = 12  # the most options the menu shows at once
ARROW = " ▼"


def same(a: Any, b: Any) -> bool:
    """Equal and of one type: a choice of True is not a choice of 1."""
    return a is b or (type(a) is type(b) and a == b)


class ChoiceField(Widget, can_focus=True):
    """Holds `value`, one of `options` ((label, value) pairs) or BLANK. Setting `value` (from code or the menu) to
    another value posts Changed, as a Select does."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter,down,space,up", "open", "Show menu", show=False),
    ]

    class Changed(Message):
        """The value changed (to BLANK when the options no longer hold it)."""

        def __init__(self, field: ChoiceField, value: Any) -> None:
            super().__init__()
            self.field = field
            self.value = value

        @property
        def control(self) -> ChoiceField:
            return self.field

    def __init__(
        self, options: Iterable[tuple[str, Any]] = (), *, prompt: str = "", id: str | None = None, tooltip: str = ""
    ) -> None:
        super().__init__(id=id)
        self._options: list[tuple[str, Any]] = list(options)
        self._value: Any = BLANK
        self.prompt = prompt  # shown while no option is chosen
        if tooltip:
            self.tooltip = tooltip

    @property
    def options(self) -> list[tuple[str, Any]]:
        return list(self._options)

    def set_options(self, options: Iterable[tuple[str, Any]]) -> None:
        """New options; the value stays if they hold it, else it is BLANK (without a Changed message)."""
        self._options = list(options)
        if self._index(self._value) is None:
            self._value = BLANK
        self.refresh()

    @property
    def value(self) -> Any:
        return self._value

    @value.setter
    def value(self, value: Any) -> None:
        if value is not BLANK and self._index(value) is None:
            raise ValueError(f"{value!r} is not one of the options of #{self.id}")
        if same(value, self._value):
            return
        self._value = value
        self.refresh()
        self.post_message(self.Changed(self, value))

    def _index(self, value: Any) -> int | None:
        return next((i for i, (_, v) in enumerate(self._options) if same(v, value)), None)

    @property
    def label(self) -> str:
        index = self._index(self._value)
        return self.prompt if index is None else self._options[index][0]

    def render(self) -> Content:
        width = self.content_size.width
        label = self.label
        room = width - cell_len(ARROW)
        if cell_len(label) > room:
            label = label[: max(room - 1, 0)] + "…"
        text = Content(label + " " * max(room - cell_len(label), 0))
        if self._value is BLANK:
            text = text.stylize("dim")
        return text + Content.styled(ARROW, "dim")

    def action_open(self) -> None:
        if not self._options:
            return

        def chosen(index: int | None) -> None:
            if index is not None and index < len(self._options):
                self.value = self._options[index][1]

        menu = ChoiceMenu([label for label, _ in self._options], self._index(self._value), self.region)
        self.app.push_screen(menu, chosen)

    def on_click(self, event: events.Click) -> None:
        event.stop()
        self.focus()
        self.action_open()


class ChoiceMenu(ModalScreen[int | None]):
    """The options of a ChoiceField in a list under (or, near the bottom, above) the field's `region`; dismissed
    with the index of the option picked by enter or a click, or None by escape or a click elsewhere. Typing jumps
    to the next option whose label starts with the letters typed."""

    DEFAULT_CSS = """
    ChoiceMenu { background: $background 0%; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss(None)", "Close", show=False)]

    def __init__(self, labels: list[str], index: int | None, region: Region) -> None:
        super().__init__()
        self.labels = labels
        self.index = index
        self.field_region = region
        self._typed = ""

    def compose(self) -> ComposeResult:
        yield OptionList(*(Content(label) for label in self.labels))

    def on_mount(self) -> None:
        menu = self.query_one(OptionList)
        field, screen = self.field_region, self.size
        height = min(len(self.labels), MENU_ROWS) + 2  # the options and the list's border
        below, above = screen.height - field.bottom, field.y
        top = field.bottom if below >= min(height, above) else max(field.y - height, 0)
        width = min(max(field.width, max(cell_len(label) for label in self.labels) + 4), screen.width)
        menu.styles.width = width
        menu.styles.max_height = below if top == field.bottom else min(height, above)
        menu.styles.offset = (min(field.x, screen.width - width), top)
        menu.highlighted = self.index if self.index is not None else 0
        menu.focus()

    @on(OptionList.OptionSelected)
    def _picked(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(event.option_index)

    def on_click(self, event: events.Click) -> None:
        if event.widget is self:  # outside the list
            self.dismiss(None)

    def on_key(self, event: events.Key) -> None:
        if not (event.is_printable and event.character and event.character.strip()):
            return
        event.stop()
        menu = self.query_one(OptionList)
        start = menu.highlighted or 0
        order = [*range(start, len(self.labels)), *range(start)]

        def first_match(typed: str) -> int | None:
            return next((i for i in order if self.labels[i].lower().startswith(typed)), None)

        self._typed += event.character.lower()
        match = first_match(self._typed)
        if match is None:  # a new word
            self._typed = event.character.lower()
            match = first_match(self._typed)
        if match is not None:
            menu.highlighted = match
