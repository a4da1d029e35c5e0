"""A unified diff, coloured, in a dialog that asks whether to write it (a config change, or a backup restored)."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.content import Content
from textual.widgets import Static

from gpuopt_tui.ui.widgets.confirm import ConfirmDialog


def line_style(line: str) -> str:
    if line.startswith(("+++", "---")):
        return "bold"
    if line.startswith("@@"):
        return "$accent"
    if line.startswith("+"):
        return "$success"
    if line.startswith("-"):
        return "$error"
    return "$text-muted"


def diff_content(diff: str) -> Content:
    """Each line of a unified diff in its colour: additions green, removals red, hunk headers in the accent."""
    return Content("\n").join(Content.styled(line, line_style(line)) for line in diff.splitlines())


class DiffDialog(ConfirmDialog):
    """A ConfirmDialog with the diff between the question and the buttons; dismissed with True to go ahead. The
    arrow and page keys scroll the diff while a button has the focus."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up", "scroll_diff('up')", "Scroll up", show=False, id="diff.up"),
        Binding("down", "scroll_diff('down')", "Scroll down", show=False, id="diff.down"),
        Binding("pageup", "scroll_diff('page_up')", "Page up", show=False, id="diff.page_up"),
        Binding("pagedown", "scroll_diff('page_down')", "Page down", show=False, id="diff.page_down"),
    ]

    DEFAULT_CSS: ClassVar[str] = """
    DiffDialog .dialog {
        width: 110;
    }
    DiffDialog .diff-view {
        height: auto;
        max-height: 60vh;
        margin-top: 1;
        border: round $panel;
    }
    """

    def __init__(self, question: str | Content, diff: str, yes: str, no: str) -> None:
        super().__init__(question, yes, no)
        self.diff = diff

    def action_scroll_diff(self, how: str) -> None:
        view = self.query_one(".diff-view", VerticalScroll)
        scroll = {
            "up": view.scroll_up,
            "down": view.scroll_down,
            "page_up": view.scroll_page_up,
            "page_down": view.scroll_page_down,
        }[how]
        scroll(animate=False)

    def compose_detail(self) -> ComposeResult:
        with VerticalScroll(classes="diff-view"):
            yield Static(diff_content(self.diff), id="diff-text")
