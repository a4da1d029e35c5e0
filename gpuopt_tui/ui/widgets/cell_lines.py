"""Lines of styled text that reach the terminal cell by cell: when a line changes, only the runs of cells that
changed are repainted, as curses does, instead of the whole widget.

What a live monitor needs over SSH: a figure that goes from 97% to 100% sends those few cells, not the line
it sits on (on a screen whose partial updates are cropped, see ui/partial_updates.py).
"""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.geometry import Region, Size
from textual.strip import Strip
from textual.widget import Widget

# Unchanged cells between two changed runs that are sent again rather than starting a new run, when they have
# the style the next run starts with: a new run costs a cursor move (some 8 bytes), a cell one to three bytes,
# and a change of style some 25.
_JOIN_GAP = 3

Cell = tuple[str, object]


def cells(strip: Strip, width: int) -> list[Cell] | None:
    """The (character, style) of each of `width` cells, blank after the strip's end; None where a character is
    not one cell wide."""
    out: list[Cell] = []
    for segment in strip:
        if segment.control:
            continue
        if len(segment.text) != segment.cell_length:
            return None
        out.extend((char, segment.style) for char in segment.text)
    return out + [(" ", None)] * (width - len(out))


def changed_runs(old: Strip, new: Strip, width: int) -> list[tuple[int, int]]:
    """[start, end) runs of the cells that differ between two lines of `width` cells; runs a few cells of the
    same style apart are joined. A wide character makes it one run over the whole line."""
    before, after = cells(old, width), cells(new, width)
    if before is None or after is None:
        return [] if old == new else [(0, width)]
    runs: list[tuple[int, int]] = []
    for x, (a, b) in enumerate(zip(before, after)):
        if a == b:
            continue
        gap = after[runs[-1][1] : x] if runs else []
        if runs and len(gap) <= _JOIN_GAP and all(style == b[1] for _, style in gap):
            runs[-1] = (runs[-1][0], x + 1)
        else:
            runs.append((x, x + 1))
    return runs


class CellLines(Widget):
    """Lines of Rich Text, given by `content_lines` for the widget's size; `redraw` repaints only the cells that
    changed since the last draw. The widget is as high as it has lines unless CSS says otherwise."""

    DEFAULT_CSS = "CellLines { height: auto; }"

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._drawn: list[Strip] = []  # the lines as drawn, at _drawn_size
        self._drawn_size = Size(0, 0)

    def content_lines(self, size: Size) -> list[Text]:
        """The lines to show at `size` (its height is 0 when the widget's height follows its lines)."""
        raise NotImplementedError

    def redraw(self) -> None:
        size = self.size
        texts = self.content_lines(size)
        if size != self._drawn_size or len(texts) != len(self._drawn):
            self._drawn_size = Size(0, 0)  # drawn whole by render_line
            self.refresh(layout=len(texts) != len(self._drawn))
            return
        for y, text in enumerate(texts):
            strip = self._strip(text, size.width)
            for start, end in changed_runs(self._drawn[y], strip, size.width):
                self.refresh(Region(start, y, end - start, 1))
            self._drawn[y] = strip

    def _strip(self, text: Text, width: int) -> Strip:
        return Strip(Segment.simplify(text.render(self.app.console))).crop(0, width)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self.content_lines(Size(width, 0)))

    def render_line(self, y: int) -> Strip:
        size, base = self.size, self.rich_style  # the theme's colours under the text's own
        if size != self._drawn_size:
            self._drawn_size = size
            self._drawn = [self._strip(text, size.width) for text in self.content_lines(size)]
        line = self._drawn[y] if y < len(self._drawn) else Strip([])
        return line.apply_style(base).adjust_cell_length(size.width, Style(bgcolor=base.bgcolor))


def one_line(text: str, width: int) -> Text:
    """Plain text on one line of `width` cells, cut with an ellipsis when too long."""
    line = Text(text, no_wrap=True)
    line.truncate(width, overflow="ellipsis")
    return line


class TextLines(CellLines):
    """Lines of plain text: a new set of lines repaints only the cells that changed (a GPU's details change a
    figure or two a poll)."""

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._lines: list[str] = []

    def set_lines(self, lines: list[str]) -> None:
        if lines != self._lines:
            self._lines = lines
            self.redraw()

    def content_lines(self, size: Size) -> list[Text]:
        return [one_line(line, size.width) for line in self._lines]
