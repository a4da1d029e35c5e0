"""Runs in a table, newest first unless sorted otherwise, optionally filtered; a refresh touches only the cells
that changed. Enter asks for the highlighted run's results (`Open`); a click on a header sorts by that column."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from rich.text import Text
from textual import on
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.widgets import DataTable

from gpuopt_tui.core.format import human_time
from gpuopt_tui.core.runs.status import RunInfo
from gpuopt_tui.ui.widgets.keyed_table import KeyedTable
from gpuopt_tui.ui.widgets.run_text import STATUS_COLOR, eta_text, first_line, progress_text

FULL_COLUMNS = ("status", "kind", "name", "progress", "eta", "created", "message", "id")
BRIEF_COLUMNS = ("status", "kind", "name", "progress", "eta", "created", "message")
MESSAGE_WIDTH = 60  # first line of a run's message, cut to this; the detail pane shows all of it
FILTERED_FIELDS = ("id", "kind", "name", "status")  # what a filter's text is looked for in
SORTS = ("created", "status", "kind", "name", "id")  # the columns `next_sort` steps through
NEWEST_FIRST = ("created", True)


def _fraction(info: RunInfo) -> float:
    return -1.0 if info.fraction is None else info.fraction


def _eta(info: RunInfo) -> float:
    eta = info.progress.get("eta")
    return float(eta) if isinstance(eta, (int, float)) and info.active else float("inf")


SORT_KEYS: dict[str, Callable[[RunInfo], Any]] = {
    "status": lambda r: r.status,
    "kind": lambda r: r.kind,
    "name": lambda r: r.name.casefold(),
    "progress": _fraction,
    "eta": _eta,
    "created": lambda r: (r.created, r.id),
    "message": lambda r: r.message,
    "id": lambda r: r.id,
}


def matches(info: RunInfo, text: str) -> bool:
    """Whether `text` (any case) is in the run's id, kind, profile name or status."""
    needle = text.casefold()
    return any(needle in str(getattr(info, name)).casefold() for name in FILTERED_FIELDS)


class RunsTable(KeyedTable):
    """A row per run, keyed by run id."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "select_cursor", "Results", id="runs.open", tooltip="Open the run's results"),
    ]

    class Open(Message):
        """Enter on a run: show its results."""

        def __init__(self, run_id: str) -> None:
            super().__init__()
            self.run_id = run_id

    def __init__(self, columns: Sequence[str] = FULL_COLUMNS, *, id: str | None = None) -> None:
        super().__init__(columns, id=id)
        self.filter_text = ""
        self.sort_column, self.descending = NEWEST_FIRST
        self.runs: Sequence[RunInfo] = ()  # every run, as last given
        self.shown: list[RunInfo] = []  # those that pass the filter, in the table's order

    def update_runs(self, runs: Sequence[RunInfo]) -> None:
        self.runs = runs
        shown = [r for r in runs if matches(r, self.filter_text)] if self.filter_text else list(runs)
        shown.sort(key=SORT_KEYS[self.sort_column], reverse=self.descending)  # stable: ties stay newest first
        self.shown = shown
        colors = self.app.get_css_variables()
        self.set_rows({r.id: self._cells(r, colors) for r in shown})

    def set_filter(self, text: str) -> None:
        self.filter_text = text.strip()
        self.update_runs(self.runs)

    def sort_by(self, column: str) -> None:
        """Sort by a column: times and progress largest first, text A to Z; the same column again reverses."""
        if column == self.sort_column:
            self.descending = not self.descending
        else:
            self.sort_column, self.descending = column, column in ("created", "progress")
        selected = self.selected_id
        self.relabel({self.sort_column: f"{self.sort_column}{' ▼' if self.descending else ' ▲'}"})
        self.update_runs(self.runs)
        if selected is not None:
            self.select(selected)

    def next_sort(self) -> None:
        position = SORTS.index(self.sort_column) if self.sort_column in SORTS else -1
        self.sort_by(SORTS[(position + 1) % len(SORTS)])

    @on(DataTable.HeaderSelected)
    def _header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        self.sort_by(str(event.column_key.value))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return self.row_count > 0 if action == "select_cursor" else True

    def action_select_cursor(self) -> None:
        run_id = self.selected_id
        if run_id is not None:
            self.post_message(self.Open(run_id))

    def _cells(self, info: RunInfo, colors: dict[str, str]) -> tuple[Text, ...]:
        values = {
            "status": Text(info.status, style=colors.get(STATUS_COLOR.get(info.status, "").lstrip("$"), "")),
            "kind": Text(info.kind),
            "name": Text(info.name),
            "progress": Text(progress_text(info)),
            "eta": Text(eta_text(info)),
            "created": Text(human_time(info.created)),
            "message": Text(first_line(info.message, MESSAGE_WIDTH), no_wrap=True, overflow="ellipsis"),
            "id": Text(info.id),
        }
        return tuple(values[c] for c in self._columns)
