"""A data table that never shows part of a cell: a column that the table's edge (or its horizontal scroll) cuts
is drawn blank with an ellipsis at that edge, so that `0.571 ± 0.015` cut to `0.571 ± 0` never reads as another
number. Scrolling sideways shows the column whole. (For tables without fixed columns.)"""

from __future__ import annotations

from typing import TypeVar

from rich.segment import Segment
from textual.strip import Strip
from textual.widgets import DataTable

CellType = TypeVar("CellType")
ELLIPSIS = "…"


class WholeCellsTable(DataTable[CellType]):
    def render_line(self, y: int) -> Strip:
        strip = super().render_line(y)
        width = self.size.width
        left = self.scroll_offset.x
        start = 0
        for column in self.ordered_columns:
            end = start + column.get_render_width(self)
            if start < left < end:  # cut by the left edge
                strip = _blank(strip, 0, min(end - left, width), at_start=True)
            if start < left + width < end:  # cut by the right edge
                return _blank(strip, max(start - left, 0), width, at_start=False)
            start = end
        return strip


def _blank(strip: Strip, x1: int, x2: int, *, at_start: bool) -> Strip:
    """`strip` with cells x1..x2 blanked and an ellipsis at x1 (`at_start`) or at x2 - 1, in the style there."""
    if x2 <= x1:
        return strip
    style = next((segment.style for segment in strip.crop(x1, x2) if segment.text), None)
    gap = " " * (x2 - x1 - 1)
    text = ELLIPSIS + gap if at_start else gap + ELLIPSIS
    return Strip.join([strip.crop(0, x1), Strip([Segment(text, style)]), strip.crop(x2, strip.cell_length)])
