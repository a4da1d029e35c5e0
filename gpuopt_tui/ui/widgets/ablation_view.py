"""Views of a layer probing run: its probes as a sortable table, accuracy against layer as a terminal line plot
(Unicode braille), and the feature cache with a clear action."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import ClassVar

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widget import Widget
from textual.widgets import Button, DataTable, Static

from gpuopt_tui.core.caches.features import EntryGroup, FeatureCache, group_entries, natural_key
from gpuopt_tui.core.format import human_bytes, human_time
from gpuopt_tui.core.results.ablation import TABLE_HEADER, ReportedProbe, ResultRow, best_of, sort_rows, table_cells
from gpuopt_tui.ui.loading import Loaded, reply
from gpuopt_tui.ui.widgets.confirm import ConfirmDialog
from gpuopt_tui.ui.widgets.whole_cells import WholeCellsTable

# Colours of the xterm 256-colour cube (shown exactly there) and markers that tell series apart without colour.
SERIES_STYLES = (
    ("#00afff", "●"),
    ("#ffaf00", "■"),
    ("#5fd75f", "▲"),
    ("#ff5f87", "◆"),
    ("#af87ff", "▼"),
    ("#d7d700", "○"),
    ("#00d7af", "□"),
    ("#ff8700", "△"),
    ("#87afff", "◇"),
    ("#d787d7", "▽"),
)
GREY = "#808080"
BRAILLE_BLANK = 0x2800
DOT_BITS = ((0x01, 0x08), (0x02, 0x10), (0x04, 0x20), (0x40, 0x80))  # [dot row][dot column] within a cell
Y_LABEL_WIDTH = 4  # "0.85"
MIN_PLOT_WIDTH, MIN_PLOT_HEIGHT = 12, 3
MARKER_SPACING = 3  # cells between neighbouring layers needed to draw markers on the points


class BrailleCanvas:
    """Terminal cells of 2 x 4 dots each (braille characters), one colour per cell; a marker glyph replaces a
    cell's dots. Dot (0, 0) is the top left."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self._bits = [[0] * width for _ in range(height)]
        self._colors: list[list[str | None]] = [[None] * width for _ in range(height)]
        self._glyphs: list[list[str | None]] = [[None] * width for _ in range(height)]

    @property
    def dots_x(self) -> int:
        return 2 * self.width

    @property
    def dots_y(self) -> int:
        return 4 * self.height

    def dot(self, x: int, y: int, color: str) -> None:
        if 0 <= x < self.dots_x and 0 <= y < self.dots_y:
            row, col = y // 4, x // 2
            self._bits[row][col] |= DOT_BITS[y % 4][x % 2]
            self._colors[row][col] = color

    def line(self, x0: int, y0: int, x1: int, y1: int, color: str) -> None:
        """Every dot on the straight line between two dots, both ends included (Bresenham)."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x1 > x0 else -1), (1 if y1 > y0 else -1)
        error = dx + dy
        while True:
            self.dot(x0, y0, color)
            if x0 == x1 and y0 == y1:
                return
            doubled = 2 * error
            if doubled >= dy:
                error += dy
                x0 += sx
            if doubled <= dx:
                error += dx
                y0 += sy

    def mark(self, x: int, y: int, glyph: str, color: str) -> None:
        """Put a glyph in the cell holding dot (x, y)."""
        if 0 <= x < self.dots_x and 0 <= y < self.dots_y:
            self._glyphs[y // 4][x // 2] = glyph
            self._colors[y // 4][x // 2] = color

    def cell(self, col: int, row: int) -> tuple[str, str | None]:
        """(character, colour) of a cell; a cell with nothing drawn is a space."""
        glyph, bits = self._glyphs[row][col], self._bits[row][col]
        return glyph or (chr(BRAILLE_BLANK + bits) if bits else " "), self._colors[row][col]


@dataclass(frozen=True)
class PlotData:
    """What the plot shows: per representation, (layer index, accuracy mean, std) in layer order; a
    representation without points yet is in the legend only."""

    split: str
    series: dict[str, list[tuple[int, float, float]]]
    whole: dict[str, tuple[float, float]] = field(default_factory=dict)  # all-layers probes: (mean, std)
    chance: float | None = None
    note: str = ""  # said in the title, e.g. how many probes have finished so far
    empty: str = "No accuracies to plot yet."


def y_range(values: Sequence[float]) -> tuple[float, float]:
    """Axis limits on a 0.1 grid around the values (inside [0, 1]), at least 0.2 apart, with a little room below
    the lowest value so that a chance line there stays visible."""
    lo = max(0.0, math.floor((min(values) - 0.02) * 10) / 10)
    hi = min(1.0, math.ceil(max(values) * 10 - 1e-9) / 10)
    if hi - lo < 0.2:
        hi = min(1.0, lo + 0.2)
        lo = max(0.0, hi - 0.2)
    return lo, hi


def y_ticks(lo: float, hi: float, rows: int) -> list[float]:
    """Round tick values, at most one every other row."""
    for step in (0.05, 0.1, 0.2, 0.25, 0.5, 1.0):
        if (hi - lo) / step + 1 <= max(2, (rows + 1) // 2):
            break
    first = math.ceil(lo / step - 1e-9)
    return [round(i * step, 6) for i in range(first, math.floor(hi / step + 1e-9) + 1)]


def x_labels(positions: list[tuple[int, str]], width: int) -> str:
    """A line of labels centred under their cells, dropping those that would touch a neighbour; the first and
    the last label are placed first."""
    line = [" "] * width
    taken: list[tuple[int, int]] = []
    ordered = positions[:1] + positions[-1:] + positions[1:-1] if len(positions) > 1 else positions
    for col, label in ordered:
        start = min(max(0, col - (len(label) - 1) // 2), width - len(label))
        end = start + len(label)
        if start < 0 or any(start <= b + 1 and end >= a - 1 for a, b in taken):
            continue
        taken.append((start, end - 1))
        line[start:end] = label
    return "".join(line)


def series_style(index: int) -> tuple[str, str]:
    return SERIES_STYLES[index % len(SERIES_STYLES)]


class AccuracyPlot(Widget):
    """Accuracy (y) against layer index (x), a line per representation, with the chance level as a dashed line
    and a legend below. Drawn for the widget's current size."""

    DEFAULT_CSS = """
    AccuracyPlot {
        height: 1fr;
        width: 1fr;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.data: PlotData | None = None

    def show(self, data: PlotData) -> None:
        self.data = data
        self.refresh()

    def render(self) -> Text:
        return self.draw(self.size.width, self.size.height)

    def draw(self, width: int, height: int) -> Text:
        data = self.data
        if data is None or not any(data.series.values()):
            return Text(data.empty if data else "", style=GREY)
        legend = self._legend(data, width)
        plot_w, plot_h = width - Y_LABEL_WIDTH - 2, height - 3 - len(legend)
        if plot_w < MIN_PLOT_WIDTH or plot_h < MIN_PLOT_HEIGHT:
            return Text("Too little room for the plot: ctrl+o zooms the results.", style=GREY)
        title = f"{data.split} accuracy by layer index" + (f" · {data.note}" if data.note else "")
        lines = [Text(title, style="bold", no_wrap=True, overflow="ellipsis")]
        lines += self._plot(data, plot_w, plot_h)
        lines += legend
        return Text("\n").join(lines)

    def _plot(self, data: PlotData, width: int, height: int) -> list[Text]:
        canvas = BrailleCanvas(width, height)
        means = [mean for points in data.series.values() for _, mean, _ in points]
        lo, hi = y_range(means + ([data.chance] if data.chance is not None else []))
        indices = sorted({index for points in data.series.values() for index, _, _ in points})
        first, last = indices[0], indices[-1]

        def x_of(index: int) -> int:
            if first == last:
                return canvas.dots_x // 2
            return round((index - first) / (last - first) * (canvas.dots_x - 1))

        def y_of(value: float) -> int:
            return round((hi - value) / (hi - lo) * (canvas.dots_y - 1))

        if data.chance is not None:
            y = y_of(data.chance)
            for x in range(canvas.dots_x):
                if x % 4 < 2:
                    canvas.dot(x, y, GREY)
        spacing = min((x_of(b) - x_of(a)) // 2 for a, b in pairwise(indices)) if len(indices) > 1 else width
        for i, points in enumerate(data.series.values()):  # an empty series draws nothing, keeps its style
            color, marker = series_style(i)
            dots = [(x_of(index), y_of(mean)) for index, mean, _ in points]
            for (x0, y0), (x1, y1) in pairwise(dots):
                canvas.line(x0, y0, x1, y1, color)
            for x, y in dots:
                if spacing >= MARKER_SPACING or len(dots) == 1:
                    canvas.mark(x, y, marker, color)
                else:
                    canvas.dot(x, y, color)

        ticks = {y_of(v) // 4: v for v in y_ticks(lo, hi, height)}
        lines = []
        for row in range(height):
            label = f"{ticks[row]:.2f}" if row in ticks else ""
            line = Text(f"{label:>{Y_LABEL_WIDTH}} " + ("┤" if row in ticks else "│"), style=GREY)
            for col in range(width):
                char, color = canvas.cell(col, row)
                line.append(char, style=color or "")
            lines.append(line)
        tick_cols = {x_of(index) // 2: str(index) for index in indices}
        axis = "".join("┬" if col in tick_cols else "─" for col in range(width))
        pad = " " * (Y_LABEL_WIDTH + 1)
        lines.append(Text(f"{pad}└{axis}", style=GREY))
        lines.append(Text(f"{pad} {x_labels(sorted(tick_cols.items()), width)}", style=GREY))
        return lines

    @staticmethod
    def _legend(data: PlotData, width: int) -> list[Text]:
        items = [
            Text.assemble((f"{series_style(i)[1]} ", series_style(i)[0]), name) for i, name in enumerate(data.series)
        ]
        if data.chance is not None:
            items.append(Text(f"┄ chance {data.chance:.3f}", style=GREY))
        items += [Text(f"{name} (all layers) {mean:.3f}", style=GREY) for name, (mean, _) in data.whole.items()]
        lines: list[Text] = []
        for item in items:
            if lines and lines[-1].cell_len + 2 + item.cell_len <= width:
                lines[-1].append("  ")
                lines[-1].append_text(item)
            else:
                lines.append(item.copy())
        for line in lines:
            line.truncate(width, overflow="ellipsis")
        return lines


TableRow = ResultRow | ReportedProbe


def row_key(row: TableRow) -> str:
    return f"{row.representation}\x1f{row.layer}"


MIN_NAMES_WIDTH = 12


class ProbeTable(WholeCellsTable[Text]):
    """Probes, one row each, under TABLE_HEADER; each representation's selected row (best validation accuracy,
    whatever split is charted) is bold with a ★. Clicking a column header sorts by it (again: the other way);
    `next_sort` steps through columns."""

    SORTS: ClassVar[tuple[str | None, ...]] = (None, "test acc", "val acc", "train acc", "layer", "features", "probes")

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True)
        self.split = "test"
        self.sort_column: str | None = None  # None: representation, then layer
        self.descending = False
        self._data_rows: Sequence[TableRow] = ()
        self._names_width: int | None = None  # the representation column's, where names are cut to fit

    def show_rows(self, rows: Sequence[TableRow], split: str) -> None:
        self._data_rows, self.split = rows, split
        self._rebuild()

    def sort_by(self, column: str | None) -> None:
        """Sort by a column: accuracies, sizes and times largest first; the same column again reverses."""
        if column == self.sort_column and column is not None:
            self.descending = not self.descending
        else:
            self.sort_column, self.descending = column, column not in (None, "representation", "layer")
        self._rebuild()

    def _fitted_names_width(self, cells: list[list[str]]) -> int | None:
        """The representation column's width where the table is too narrow to show the charted split's accuracy
        whole (names are cut with an ellipsis, never numbers); None (fitted to the names) where it is wide
        enough."""
        shown = TABLE_HEADER.index(f"{self.split} acc") + 1
        widths = [max([len(c) + 2, *(len(row[i]) for row in cells)]) for i, c in enumerate(TABLE_HEADER[:shown])]
        spare = self.size.width - (sum(widths) + 2 * self.cell_padding * shown)
        return max(MIN_NAMES_WIDTH, widths[0] + spare) if self.size.width and spare < 0 else None

    def on_resize(self) -> None:
        if self._data_rows:
            cells = [list(c) for c in table_cells(self._data_rows)]
            if self._fitted_names_width(cells) != self._names_width:
                self._rebuild()

    def next_sort(self) -> None:
        position = self.SORTS.index(self.sort_column) if self.sort_column in self.SORTS else 0
        self.sort_by(self.SORTS[(position + 1) % len(self.SORTS)])

    @on(DataTable.HeaderSelected)
    def _header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        self.sort_by(str(event.column_key.value))

    def _rebuild(self) -> None:
        """Lay the table out again, keeping the selected row and the scroll position."""
        selected = self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value if self.row_count else None
        scroll = self.scroll_offset
        best = {row_key(r) for r in best_of(self._data_rows).values()}
        success = self.app.get_css_variables().get("success", "green")
        self.clear(columns=True)
        rows = sort_rows(self._data_rows, self.sort_column, self.descending)
        all_cells = []
        for row, row_cells in zip(rows, table_cells(rows)):
            cells = list(row_cells)
            if row_key(row) in best:
                cells[1] += " ★"
            all_cells.append(cells)
        self._names_width = self._fitted_names_width(all_cells)
        for column in TABLE_HEADER:
            arrow = (" ▼" if self.descending else " ▲") if column == self.sort_column else ""
            width = self._names_width if column == "representation" else None
            self.add_column(column + arrow, key=column, width=width)
        for row, cells in zip(rows, all_cells):
            key = row_key(row)
            style = f"bold {success}" if key in best else ""
            self.add_row(*(Text(c, style=style, overflow="ellipsis", no_wrap=True) for c in cells), key=key)
        if selected is not None and selected in self.rows:
            self.move_cursor(row=self.get_row_index(selected), scroll=False)
        self.call_after_refresh(self.scroll_to, scroll.x, scroll.y, animate=False)


@dataclass(frozen=True)
class CacheListing:
    root: Path
    groups: list[EntryGroup]
    entries: int
    size: int


def read_listing() -> CacheListing:
    cache = FeatureCache()
    entries = cache.entries()
    return CacheListing(cache.root, group_entries(entries), len(entries), cache.size_bytes())


def clear_cache() -> tuple[int, int, CacheListing]:
    """Delete every entry: (entries removed, bytes freed, the cache as it is afterwards)."""
    cleared = FeatureCache().clear()
    return cleared.removed, cleared.freed, read_listing()


def layer_span(layers: Sequence[str]) -> str:
    """ "layer.0 … layer.11 (12)" for many layers, the names themselves for one or two."""
    if len(layers) <= 2:
        return ", ".join(layers)
    ordered = sorted(layers, key=natural_key)
    return f"{ordered[0]} … {ordered[-1]} ({len(layers)})"


class CacheListingRead(Loaded):
    """The feature cache's listing (a CacheListing)."""


class CacheListingToAsk(Loaded):
    """The listing, read again to ask whether to clear what it holds now."""


class CacheCleared(Loaded):
    """The cache was cleared: (entries removed, bytes freed, the listing after)."""


class CachePanel(Vertical):
    """The feature cache (the user cache folder's features): its size, its entries grouped by representation
    and source, and a clear action that asks first. Read in a thread on `reload()`; never polled."""

    DEFAULT_CSS = """
    CachePanel {
        height: 1fr;
    }
    CachePanel .cache-summary {
        height: auto;
        color: $text-muted;
    }
    CachePanel DataTable {
        height: 1fr;
    }
    CachePanel Button {
        margin-top: 0;
    }
    """
    COLUMNS = ("representation", "layers", "size", "created", "source")

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.listing: CacheListing | None = None
        self.run_going = False  # a probing run is going on (it writes to the cache)

    def compose(self) -> ComposeResult:
        yield Static("Reading the feature cache…", classes="cache-summary", markup=False)
        yield DataTable[Text](id="cache-table", cursor_type="row", zebra_stripes=True)
        yield Button("Clear cache…", id="cache-clear", variant="error", compact=True, disabled=True)

    def on_mount(self) -> None:
        table = self.query_one("#cache-table", DataTable)
        for column in self.COLUMNS:
            table.add_column(column, key=column)

    def reload(self) -> None:
        self._read_listing()

    @work(thread=True, exclusive=True, group="feature-cache", exit_on_error=False)
    def _read_listing(self) -> None:
        reply(self, CacheListingRead, None, read_listing)

    @work(thread=True, exclusive=True, group="feature-cache-ask", exit_on_error=False)
    def _read_to_ask(self) -> None:
        """The listing, to ask whether to clear it (a reload meanwhile, e.g. on showing the view, does not cancel
        it)."""
        reply(self, CacheListingToAsk, None, read_listing)

    @work(thread=True, exclusive=True, group="feature-cache-clear", exit_on_error=False)
    def _clear(self) -> None:
        reply(self, CacheCleared, None, clear_cache)

    def _show(self, listing: CacheListing) -> None:
        self.listing = listing
        summary = self.query_one(".cache-summary", Static)
        if listing.entries:
            summary.update(f"{listing.entries} entries, {human_bytes(listing.size)} in {listing.root}")
        else:
            summary.update(f"The feature cache is empty ({listing.root}).")
        table = self.query_one("#cache-table", DataTable)
        table.clear()
        for group in listing.groups:
            table.add_row(
                Text(group.representation or "unreadable entries", style="" if group.ok else "bold"),
                Text(layer_span(group.layers) if group.ok else f"{group.entries} entries"),
                Text(human_bytes(group.size)),
                Text(human_time(group.created)),
                Text(group.source),
            )
        table.display = bool(listing.groups)
        self.query_one("#cache-clear", Button).disabled = not listing.entries

    def _failed(self, message: Loaded) -> bool:
        """Whether the cache could not be read or cleared (then said in a notification)."""
        if message.failed:
            self.app.notify(message.reason, title="Feature cache", severity="error", timeout=10, markup=False)
        return message.failed

    @on(CacheListingRead)
    def _listing_read(self, message: CacheListingRead) -> None:
        if not self._failed(message):
            self._show(message.value)

    @on(CacheListingToAsk)
    def _listing_to_ask(self, message: CacheListingToAsk) -> None:
        if not self._failed(message):
            self._show(message.value)
            self._ask(message.value)

    @on(CacheCleared)
    def _cleared(self, message: CacheCleared) -> None:
        if self._failed(message):
            return
        entries, freed, listing = message.value
        self.app.notify(f"removed {entries} entries ({human_bytes(freed)})", title="Feature cache cleared")
        self._show(listing)

    @on(Button.Pressed, "#cache-clear")
    def action_clear(self) -> None:
        """Read the cache again, ask whether to clear what it holds now, then clear it in a thread."""
        self._read_to_ask()

    def _ask(self, listing: CacheListing) -> None:
        if not listing.entries:
            self.app.notify("The feature cache is already empty.", title="Feature cache")
            return
        question = (
            f"Clear the feature cache? {listing.entries} entries, {human_bytes(listing.size)} in {listing.root}. "
            "Features are computed again when next needed."
        )
        if self.run_going:
            question += " A probing run is going on: it fails if it is writing features now."

        def answered(yes: bool | None) -> None:
            if yes:
                self._clear()

        self.app.push_screen(ConfirmDialog(question, "Clear", "Keep"), answered)
