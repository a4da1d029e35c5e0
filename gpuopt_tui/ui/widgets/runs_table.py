"""Runs in a table, newest first; a refresh touches only the cells that changed."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widgets import DataTable

from gpuopt_tui.core.format import human_time
from gpuopt_tui.core.runs import RunInfo
from gpuopt_tui.ui.widgets.run_text import STATUS_COLOR, eta_text, progress_text

FULL_COLUMNS = ("status", "kind", "name", "progress", "eta", "created", "message", "id")
BRIEF_COLUMNS = ("status", "kind", "name", "progress", "eta", "created", "message")
MESSAGE_WIDTH = 60  # first line of a run's message, cut to this; the detail pane shows all of it


class RunsTable(DataTable[Text]):
    """A row per run, keyed by run id. `update_runs` adds, removes and updates rows in place."""

    def __init__(self, columns: Sequence[str] = FULL_COLUMNS, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True)
        self._columns = tuple(columns)
        self._shown: dict[str, tuple[str, ...]] = {}  # run id -> plain text of each cell, as displayed

    def on_mount(self) -> None:
        for column in self._columns:
            self.add_column(column, key=column)

    @property
    def selected_id(self) -> str | None:
        if not self.row_count:
            return None
        row_key, _ = self.coordinate_to_cell_key(self.cursor_coordinate)
        return row_key.value

    def select(self, run_id: str) -> None:
        if run_id in self._shown:
            self.move_cursor(row=self.get_row_index(run_id))

    def update_runs(self, runs: Sequence[RunInfo]) -> None:
        colors = self.app.get_css_variables()
        cells = {r.id: self._cells(r, colors) for r in runs}
        order = [r.id for r in runs]
        if order != list(self._shown):
            self._rebuild(order, cells)
            return
        for run_id, new in cells.items():
            old = self._shown[run_id]
            for column, before, after in zip(self._columns, old, new):
                if before != after.plain:
                    self.update_cell(run_id, column, after, update_width=True)
            self._shown[run_id] = tuple(c.plain for c in new)

    def _rebuild(self, order: list[str], cells: dict[str, tuple[Text, ...]]) -> None:
        """A run appeared or went away: lay the rows out again, keeping the selected run selected."""
        selected = self.selected_id
        self.clear()
        self._shown = {}
        for run_id in order:
            self.add_row(*cells[run_id], key=run_id)
            self._shown[run_id] = tuple(c.plain for c in cells[run_id])
        if selected in self._shown:
            self.select(selected)

    def _cells(self, info: RunInfo, colors: dict[str, str]) -> tuple[Text, ...]:
        values = {
            "status": Text(info.status, style=colors.get(STATUS_COLOR.get(info.status, "").lstrip("$"), "")),
            "kind": Text(info.kind),
            "name": Text(info.name),
            "progress": Text(progress_text(info)),
            "eta": Text(eta_text(info)),
            "created": Text(human_time(info.created)),
            "message": Text(_first_line(info.message), no_wrap=True, overflow="ellipsis"),
            "id": Text(info.id),
        }
        return tuple(values[c] for c in self._columns)


def _first_line(message: str) -> str:
    line = message.splitlines()[0] if message else ""
    return line if len(line) <= MESSAGE_WIDTH else line[: MESSAGE_WIDTH - 1] + "…"
