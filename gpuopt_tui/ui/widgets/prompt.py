"""Asks for one line of text in a modal dialog (the name of a profile to save as)."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Input, Static

from gpuopt_tui.ui.widgets.confirm import Dialog


class TextPrompt(Dialog[str | None]):
    """Dismissed with the text entered, or None on Escape. `check` returns an error message or ""."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss(None)", "Cancel", id="prompt.cancel")]

    def __init__(self, question: str, value: str = "", check: Callable[[str], str] | None = None) -> None:
        super().__init__()
        self._question = question
        self._value = value
        self._check = check

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self._question, classes="dialog-text", markup=False)
            yield Input(self._value, id="prompt-input", compact=True)
            yield Static("", id="prompt-error", classes="field-error", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("OK", variant="primary", id="ok", compact=True)
                yield Button("Cancel (esc)", id="cancel", compact=True)

    def on_mount(self) -> None:
        field = self.query_one(Input)
        field.cursor_blink = False
        field.focus()

    @on(Input.Submitted)
    @on(Button.Pressed, "#ok")
    def _submit(self) -> None:
        text = self.query_one(Input).value.strip()
        error = self._check(text) if self._check else ""
        self.query_one("#prompt-error", Static).update(error)
        if not error:
            self.dismiss(text)

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(None)
