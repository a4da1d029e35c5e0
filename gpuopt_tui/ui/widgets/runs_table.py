"""Runs in a table, newest first; a refresh touches only the cells that changed."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text

from gpuopt_tui.core.format import human_time
from gpuopt_tui.core.runs import RunInfo
from gpuopt_tui.ui.widgets.keyed_table import KeyedTable
from gpuopt_tui.ui.widgets.run_text import STATUS_COLOR, eta_text, first_line, progress_text

FULL_COLUMNS = ("status", "kind", "name", "progress", "eta", "created", "message", "id")
BRIEF_COLUMNS = ("status", "kind", "name", "progress", "eta", "created", "message")
MESSAGE_WIDTH = 60  # first line of a run's message, cut to this; the detail pane shows all of it


class RunsTable(KeyedTable):
    """A row per run, keyed by run id."""

    def __init__(self, columns: Sequence[str] = FULL_COLUMNS, *, id: str | None = None) -> None:
        super().__init__(columns, id=id)

    def update_runs(self, runs: Sequence[RunInfo]) -> None:
        colors = self.app.get_css_variables()
        self.set_rows({r.id: self._cells(r, colors) for r in runs})

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
