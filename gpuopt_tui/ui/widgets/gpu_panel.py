"""The dashboard's GPU panel: one line per GPU (memory bar, utilisation, temperature, power).

Legible for 1 to 8 cards at 100x30; with no driver or no GPU it is one line that says why.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.geometry import Size
from textual.message import Message
from textual.widgets import Static

from gpuopt_tui.core.telemetry import display
from gpuopt_tui.core.telemetry.backend import TelemetrySource
from gpuopt_tui.core.telemetry.fields import PANEL_CELLS, GpuSample
from gpuopt_tui.core.telemetry.history import History
from gpuopt_tui.core.telemetry.snapshot import Snapshot
from gpuopt_tui.ui.gpu_poller import GpuPoller
from gpuopt_tui.ui.widgets.cell_lines import CellLines

_EIGHTHS = " ▏▎▍▌▋▊▉"


def level_style(fraction: float | None, warn: float = 0.7, high: float = 0.9) -> str:
    if fraction is None:
        return "dim"
    return "red" if fraction >= high else "yellow" if fraction >= warn else "green"


def bar(fraction: float | None, width: int) -> Text:
    """A horizontal bar in eighths of a cell; a dim track where it is empty or unknown."""
    if width <= 0:
        return Text()
    if fraction is None:
        return Text("·" * width, style="dim")
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    full, part = divmod(eighths, 8)
    filled = "█" * full + (_EIGHTHS[part] if part else "")
    return Text.assemble((filled, level_style(fraction)), ("·" * (width - len(filled)), "dim"))


def _cell(value: str, width: int, style: str = "") -> Text:
    return Text(value.rjust(width)[-width:], style="dim" if value == display.NA else style)


def gpu_line(gpu: GpuSample, width: int) -> Text:
    """One GPU in `width` cells: index, name, memory bar, then the panel's figures (memory, SM utilisation,
    temperature, power). Narrow widths drop the optional figures, last first, before the bar gets shorter than
    5 cells."""
    index = f"{gpu.index:<2}"
    name = display.short_name(gpu.name)
    if gpu.lost:
        line = Text.assemble(index, (name + " ", "bold"), ("GPU LOST: reset it or reboot", "bold red"))
        line.truncate(width)
        return line
    cells = list(PANEL_CELLS)
    fixed = len(index) + 1 + sum(1 + cell.width for cell in cells)
    for cell in reversed(PANEL_CELLS):
        if width - fixed >= 5:
            break
        if cell.optional:
            cells.remove(cell)
            fixed -= 1 + cell.width
    room = max(0, width - fixed)
    name_width = min(len(name), 22, max(0, room - 12))
    fraction = None if gpu.memory_percent is None else gpu.memory_percent / 100
    parts: list[Text | str] = [
        index,
        Text(name[:name_width].ljust(name_width), style="bold"),
        " ",
        bar(fraction, room - name_width),
    ]
    for cell in cells:
        style = "" if cell.grade is None else level_style(cell.grade(gpu), *cell.levels)
        parts += [" ", _cell(cell.text(gpu), cell.width, style)]
    line = Text.assemble(*parts)
    line.truncate(width)
    return line


def _shown_fields(gpu: GpuSample) -> tuple[object, ...]:
    """What a GPU line shows, as shown: a new sample that shows the same is not redrawn."""
    return (gpu.index, gpu.name, gpu.lost, *(cell.text(gpu) for cell in PANEL_CELLS))


class GpuRow(CellLines):
    """One GPU line; repaints the cells that changed when what it shows changes."""

    DEFAULT_CSS = """
    GpuRow { height: 1; }
    GpuRow.-selected { background: $boost; text-style: bold; }
    """

    class Clicked(Message):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index

    def __init__(self, gpu: GpuSample) -> None:
        super().__init__()
        self.gpu = gpu
        self._shown = _shown_fields(gpu)

    def show(self, gpu: GpuSample) -> None:
        self.gpu = gpu
        shown = _shown_fields(gpu)
        if shown != self._shown:
            self._shown = shown
            self.redraw()

    def content_lines(self, size: Size) -> list[Text]:
        return [gpu_line(self.gpu, size.width)]

    def on_click(self) -> None:
        self.post_message(self.Clicked(self.gpu.index))


class GpuRows(Vertical):
    """A GpuRow per GPU of the latest snapshot, mounted or removed as the GPU count changes."""

    DEFAULT_CSS = "GpuRows { height: auto; }"

    def show(self, gpus: tuple[GpuSample, ...]) -> None:
        rows = list(self.query_children(GpuRow))
        for row, gpu in zip(rows, gpus):
            row.show(gpu)
        if len(rows) > len(gpus):
            for row in rows[len(gpus) :]:
                row.remove()
        elif len(gpus) > len(rows):
            self.mount_all(GpuRow(gpu) for gpu in gpus[len(rows) :])

    def select(self, index: int | None) -> None:
        for row in self.query_children(GpuRow):
            row.set_class(row.gpu.index == index, "-selected")


class TextBlock(Static):
    """Plain text (no markup) that is replaced only when it changes; the layout is redone only when its number
    of lines changes (a layout pass of a whole screen costs far more than drawing a few lines)."""

    DEFAULT_CSS = "TextBlock { height: auto; }"

    def __init__(self, text: str = "", *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(text, id=id, classes=classes, markup=False)
        self._text = text

    def set_text(self, text: str) -> None:
        if text != self._text:
            resized = text.count("\n") != self._text.count("\n")
            self._text = text
            self.update(text, layout=resized)


class OneLine(TextBlock):
    """One line of text, cut with an ellipsis when too long."""

    DEFAULT_CSS = "OneLine { height: 1; text-wrap: nowrap; text-overflow: ellipsis; }"


def process_summary(snapshot: Snapshot) -> str:
    count = len({p.pid for p in snapshot.processes})
    runs = len({p.run_id for p in snapshot.processes if p.run_id})
    text = f"{count} process{'es' if count != 1 else ''}"
    return text + (f" · {runs} run{'s' if runs != 1 else ''}" if runs else "")


def no_gpu_text(snapshot: Snapshot) -> str:
    return f"No GPU: {snapshot.message or 'nothing to show'}"


class GpuPanel(Vertical):
    """Compact live GPU panel. Polls `source` every `interval` seconds while visible; feeds `history` if given
    (share it with the GPU screen so its plots continue). Posts GpuPanel.Selected when a GPU line is clicked."""

    DEFAULT_CSS = """
    GpuPanel { height: auto; border: round $primary 50%; border-title-color: $text; padding: 0 1; }
    GpuPanel > #gpu-message { color: $text-muted; }
    GpuPanel > #gpu-note { color: $warning; }
    """

    class Selected(Message):
        """The user picked a GPU in the panel (the app may open the GPU screen on it)."""

        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index

    def __init__(
        self,
        source: TelemetrySource,
        interval: float = 1.0,
        history: History | None = None,
        *,
        id: str | None = None,
        classes: str | None = None,
    ) -> None:
        super().__init__(id=id, classes=classes)
        self.source = source
        self.interval = interval
        self.history = history
        self.snapshot: Snapshot | None = None

    def compose(self) -> ComposeResult:
        yield GpuPoller(self.source, self.interval)
        yield OneLine("Reading GPUs…", id="gpu-message")
        yield GpuRows()
        yield OneLine(id="gpu-note")

    def on_mount(self) -> None:
        self.border_title = "GPU"
        self.query_one("#gpu-note").display = False

    def on_show(self) -> None:
        self.query_one(GpuPoller).wake()

    def on_gpu_poller_polled(self, message: GpuPoller.Polled) -> None:
        message.stop()
        self.apply(message.snapshot)

    def apply(self, snapshot: Snapshot) -> None:
        """Draw a snapshot, touching only what changed."""
        self.snapshot = snapshot
        if self.history is not None:
            self.history.add(snapshot)
        message = self.query_one("#gpu-message", OneLine)
        note = self.query_one("#gpu-note", OneLine)
        with self.app.batch_update():
            self.border_title = f"GPU · {self.source.label}"
            message.display = not snapshot.has_gpus
            if not snapshot.has_gpus:
                message.set_text(no_gpu_text(snapshot))
            self.query_one(GpuRows).show(snapshot.gpus)
            self.border_subtitle = process_summary(snapshot) if snapshot.has_gpus else ""
            note.display = bool(snapshot.notes)
            note.set_text(snapshot.notes[0] if snapshot.notes else "")

    def on_gpu_row_clicked(self, message: GpuRow.Clicked) -> None:
        message.stop()
        self.post_message(self.Selected(message.index))
