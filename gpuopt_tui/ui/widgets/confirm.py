"""A yes/no question in a modal dialog (cancel a run, delete a run, discard edits, overwrite a file)."""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.screen import ModalScreen, ScreenResultType
from textual.widgets import Button, Static


class Dialog(ModalScreen[ScreenResultType]):
    """A box in the middle of the screen over the dimmed screen below: subclasses compose a `.dialog` container
    holding a `.dialog-text` and a `.dialog-buttons` row. Styled here, so any app can use it as it is."""

    DEFAULT_CSS = """
    Dialog { align: center middle; }
    Dialog .dialog {
        width: 72;
        max-width: 95%;
        height: auto;
        padding: 1 2;
        border: thick $warning 60%;
        background: $surface;
    }
    Dialog .dialog-buttons { height: auto; margin-top: 1; }
    Dialog .dialog-buttons Button { margin-right: 2; }
    """


class ConfirmDialog(Dialog[bool]):
    """Dismissed with True when confirmed; Escape or "n" answer no."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Yes", id="confirm.yes"),
        Binding("n,escape", "answer(False)", "No", id="confirm.no"),
    ]

    def __init__(self, question: str | Content, yes: str = "Yes", no: str = "No") -> None:
        super().__init__()
        self._question = question
        self._yes = yes
        self._no = no

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self._question, classes="dialog-text", markup=False)
            yield from self.compose_detail()
            with Horizontal(classes="dialog-buttons"):
                yield Button(f"{self._yes} (y)", variant="error", id="yes", compact=True)
                yield Button(f"{self._no} (n)", id="no", compact=True)

    def compose_detail(self) -> ComposeResult:
        """What goes between the question and the buttons (nothing by default)."""
        yield from ()

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")
