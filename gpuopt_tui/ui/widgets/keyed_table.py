"""A DataTable of rows keyed by id, refreshed in place: only the cells that changed are touched."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rich.text import Text
from textual.events import Resize
from textual.widgets import DataTable
from textual.widgets.data_table import CursorType


class KeyedTable(DataTable[Text]):
    """`set_rows` adds, removes and updates rows; the cursor stays on its row's key."""

    def __init__(
        self,
        columns: Sequence[str],
        *,
        id: str | None = None,
        classes: str | None = None,
        cursor_type: CursorType = "row",
    ) -> None:
        # classes given here, not added after: a class added to a widget not yet mounted restyles it at once
        super().__init__(id=id, classes=classes, cursor_type=cursor_type, zebra_stripes=True)
        self._columns = tuple(columns)
        self._shown: dict[str, tuple[str, ...]] = {}  # row key -> plain text of each cell, as displayed
        self._laid_out = False

    def on_resize(self, event: Resize) -> None:
        # A cursor moved before the table had a size (rows filled in a screen built before it is shown) scrolled the
        # table by its row, to no view at all: on its first size, scrolled from the top again, to the cursor.
        if not self._laid_out:
            self._laid_out = True
            if self.scroll_y:
                self.scroll_to(y=0, animate=False, immediate=True)
                self.move_cursor(row=self.cursor_row, animate=False)

    def on_mount(self) -> None:
        for column in self._columns:
            self.add_column(column, key=column)

    def relabel(self, labels: Mapping[str, str]) -> None:
        """Label columns anew (by their key; the others keep theirs): the table is emptied, columns and all, for
        `set_rows` to fill again."""
        self.clear(columns=True)
        self._shown = {}
        for column in self._columns:
            self.add_column(labels.get(column, column), key=column)

    @property
    def selected_id(self) -> str | None:
        if not self.row_count:
            return None
        row_key, _ = self.coordinate_to_cell_key(self.cursor_coordinate)
        return row_key.value

    def select(self, key: str) -> None:
        if key in self._shown:
            self.move_cursor(row=self.get_row_index(key))

    def set_rows(self, rows: Mapping[str, Sequence[Text]], relayout: bool = False) -> None:
        """Show `rows` (key -> a cell per column), in their order; `relayout`: most cells changed (laying the table
        out again is then quicker than measuring each column again at each changed cell)."""
        if relayout or list(rows) != list(self._shown):
            self._rebuild(rows)
            return
        for key, new in rows.items():
            old = self._shown[key]
            for column, before, after in zip(self._columns, old, new):
                if before != after.plain:
                    self.update_cell(key, column, after, update_width=True)
            self._shown[key] = tuple(c.plain for c in new)

    def _rebuild(self, rows: Mapping[str, Sequence[Text]]) -> None:
        """A row appeared or went away: lay the rows out again, keeping the selected row selected."""
        selected = self.selected_id
        self.clear()
        self._shown = {}
        for key, cells in rows.items():
            self.add_row(*cells, key=key)
            self._shown[key] = tuple(c.plain for c in cells)
        if selected in self._shown:
            self.select(selected)
