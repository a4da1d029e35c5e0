"""History plots of one GPU: a series over the history window in columns of eighth blocks."""

from __future__ import annotations

from rich.text import Text
from textual.geometry import Size

from gpuopt_tui.core.telemetry.history import History
from gpuopt_tui.ui.widgets.cell_lines import CellLines

_BARS = " ▁▂▃▄▅▆▇█"


def plot_text(values: list[float | None], height: int, style: str) -> Text:
    """Columns of eighth blocks on a fixed 0-100 scale, `height` lines; blank where there is no sample,
    a dim baseline where the value is zero."""
    lines = []
    for level in range(height - 1, -1, -1):
        line = Text()
        for value in values:
            if value is None:
                line.append(" ")
                continue
            eighths = round(max(0.0, min(100.0, value)) / 100 * height * 8) - level * 8
            if eighths <= 0:
                line.append("▁" if level == 0 else " ", style="dim" if level == 0 else "")
            else:
                line.append(_BARS[min(8, eighths)], style=style)
        lines.append(line)
    return Text("\n").join(lines)


class HistoryPlot(CellLines):
    """One series of one GPU over the history window, a column per window / width seconds, sweeping left to
    right: a completed column replaces the one from a window earlier, next to a blank column that marks now.
    Nothing else moves (a scrolling plot would repaint every row of the plot a column), so a new column sends
    only its cells that differ."""

    DEFAULT_CSS = "HistoryPlot { height: 1fr; min-height: 3; }"  # grows with the terminal

    def __init__(self, series: str, style: str, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.series = series
        self.style = style
        self.values: list[float | None] = []  # a column each
        self._source: tuple[History, int] | None = None

    def show(self, history: History, index: int) -> None:
        self._source = (history, index)
        values = history.sweep(index, self.series, self.size.width)
        if values != self.values:
            self.values = values
            self.redraw()

    def content_lines(self, size: Size) -> list[Text]:
        if self._source is not None and len(self.values) != size.width:
            history, index = self._source
            self.values = history.sweep(index, self.series, size.width)
        return plot_text(self.values, size.height, self.style).split("\n") if size.height else []
