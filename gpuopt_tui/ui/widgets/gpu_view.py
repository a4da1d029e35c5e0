"""The GPU view, the body of the GPU screens: a line per GPU (when there are several), details and history plots of
the selected one, and its processes. Only the characters that change reach the terminal (see widgets/cell_lines.py).

Processes of the current user can be sent SIGINT / SIGTERM / SIGKILL with I, T and K (capitals, as in nvitop,
so they never shadow an app's lower-case keys) after a confirmation, unless the screen is read-only (or shows a
replayed trace, whose pids belong to another machine).
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.geometry import Size
from textual.message import Message

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.telemetry import display
from gpuopt_tui.core.telemetry.backend import TelemetrySource
from gpuopt_tui.core.telemetry.fields import GpuSample, detail_lines
from gpuopt_tui.core.telemetry.history import History
from gpuopt_tui.core.telemetry.procinfo import send_signal, start_time
from gpuopt_tui.core.telemetry.snapshot import ProcessSample, Snapshot
from gpuopt_tui.ui.gpu_poller import GpuPoller
from gpuopt_tui.ui.widgets.cell_lines import CellLines, TextLines, one_line
from gpuopt_tui.ui.widgets.confirm import ConfirmDialog
from gpuopt_tui.ui.widgets.gpu_panel import GpuRow, GpuRows, OneLine, no_gpu_text, process_summary
from gpuopt_tui.ui.widgets.history_plot import HistoryPlot

_HEADER = f"{'GPU':>3}  {'PID':>8}  {'USER':<10}  {'GPU MEM':>11}  {'RUN':<20}  COMMAND"


def detail_text(gpu: GpuSample) -> str:
    head = f"GPU {gpu.index}  {gpu.name or display.NA}\nUUID    {gpu.uuid or display.NA}\n"
    if gpu.lost:
        return head + "LOST: the driver lost this GPU; it needs a reset (nvidia-smi -r) or a reboot"
    return head + "\n".join(detail_lines(gpu))


def process_key(process: ProcessSample) -> str:
    return f"{process.gpu_index}:{process.pid}"


def run_label(run_id: str, width: int = 20) -> str:
    """A run id in `width` columns: its kind and random suffix (YYYYMMDD-HHMMSS-KIND-XXXX), which tell runs
    apart on a GPU's process list, rather than its date."""
    parts = run_id.split("-")
    label = "-".join(parts[2:]) if len(parts) >= 4 and parts[0].isdigit() else run_id
    return label if len(label) <= width else label[: width - 1] + "…"


def process_text(process: ProcessSample) -> str:
    memory = display.NA if process.gpu_memory is None else f"{process.gpu_memory / 2**20:,.0f} MiB"
    user = (process.user or "?")[:10]
    run = run_label(process.run_id or "")
    return f"{process.gpu_index:>3}  {process.pid:>8}  {user:<10}  {memory:>11}  {run:<20}  {process.command or '?'}"


class ProcessLine(CellLines):
    """One process; repaints the cells that changed (a table would redraw every row for one changed cell)."""

    DEFAULT_CSS = """
    ProcessLine { height: 1; }
    ProcessLine.-cursor { background: $boost; }
    ProcessList:focus > ProcessLine.-cursor { background: $accent 50%; }
    """

    def __init__(self, process: ProcessSample) -> None:
        super().__init__()
        self.process = process
        self._text = process_text(process)

    def show(self, process: ProcessSample) -> None:
        self.process = process
        text = process_text(process)
        if text != self._text:
            self._text = text
            self.redraw()

    def content_lines(self, size: Size) -> list[Text]:
        return [one_line(self._text, size.width)]

    def on_click(self) -> None:
        if isinstance(self.parent, ProcessList):
            self.parent.move_to(process_key(self.process))


class ProcessList(VerticalScroll, can_focus=True):
    """GPU processes ordered by GPU and pid, with a cursor (up/down) and Enter to choose one."""

    DEFAULT_CSS = "ProcessList { height: 1fr; }"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up", "move(-1)", "Up", show=False, tooltip="Previous process"),
        Binding("down", "move(1)", "Down", show=False, tooltip="Next process"),
        Binding("enter", "choose", "Open run", show=False, tooltip="Open the run the process belongs to"),
    ]

    class Chosen(Message):
        def __init__(self, process: ProcessSample) -> None:
            super().__init__()
            self.process = process

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.cursor = 0

    @property
    def processes(self) -> dict[str, ProcessSample]:
        return {process_key(line.process): line.process for line in self.query_children(ProcessLine)}

    def show(self, processes: tuple[ProcessSample, ...]) -> None:
        ordered = sorted(processes, key=lambda p: (p.gpu_index, p.pid))
        lines = list(self.query_children(ProcessLine))
        if [process_key(p) for p in ordered] == [process_key(line.process) for line in lines]:
            for line, process in zip(lines, ordered):
                line.show(process)
            return
        current = self.highlighted()
        self.remove_children()
        self.mount_all(ProcessLine(p) for p in ordered)
        keys = [process_key(p) for p in ordered]
        key = process_key(current) if current else None
        self.cursor = keys.index(key) if key in keys else min(self.cursor, max(0, len(keys) - 1))
        self.call_after_refresh(self._mark_cursor)

    def _mark_cursor(self) -> None:
        for i, line in enumerate(self.query_children(ProcessLine)):
            line.set_class(i == self.cursor, "-cursor")
            if i == self.cursor:
                self.scroll_to_widget(line, animate=False)

    def highlighted(self) -> ProcessSample | None:
        lines = list(self.query_children(ProcessLine))
        return lines[self.cursor].process if 0 <= self.cursor < len(lines) else None

    def move_to(self, key: str) -> None:
        keys = [process_key(line.process) for line in self.query_children(ProcessLine)]
        if key in keys:
            self.cursor = keys.index(key)
            self._mark_cursor()

    def action_move(self, step: int) -> None:
        count = len(self.query_children(ProcessLine))
        if count:
            self.cursor = max(0, min(count - 1, self.cursor + step))
            self._mark_cursor()

    def action_choose(self) -> None:
        process = self.highlighted()
        if process is not None:
            self.post_message(self.Chosen(process))


class GpuView(Vertical):
    """Live GPU details, history plots and processes: the body of the GPU screen, as a widget so that an app
    can put it under its own navigation bar."""

    DEFAULT_CSS = """
    GpuView { height: 1fr; }
    GpuView #gpu-title { background: $boost; padding: 0 1; }
    GpuView #gpu-message { padding: 0 1; color: $text-muted; }
    GpuView GpuRows { padding: 0 1; }
    GpuView #gpu-detail { height: 1fr; min-height: 8; margin-top: 1; padding: 0 1; }
    GpuView #gpu-fields { width: 1fr; min-width: 48; max-width: 60; }
    GpuView #gpu-plots { width: 1fr; height: 1fr; }
    GpuView .plot-label { color: $text-muted; }
    GpuView #gpu-note { color: $warning; padding: 0 1; }
    GpuView #process-header { margin-top: 1; padding: 0 1; text-style: bold; background: $boost; }
    GpuView ProcessList { height: auto; min-height: 3; max-height: 45%; padding: 0 1; }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("left_square_bracket", "select_gpu(-1)", "Prev GPU", id="gpu.prev"),
        Binding("right_square_bracket", "select_gpu(1)", "Next GPU", id="gpu.next"),
        Binding("I", "signal('SIGINT')", "SIGINT", id="gpu.sigint", tooltip="Interrupt the selected process"),
        Binding("T", "signal('SIGTERM')", "SIGTERM", id="gpu.sigterm", tooltip="Ask the selected process to stop"),
        Binding("K", "signal('SIGKILL')", "SIGKILL", id="gpu.sigkill", tooltip="Kill the selected process"),
        *(Binding(str(n), f"jump_gpu({n})", show=False) for n in range(10)),
    ]

    class RunRequested(Message):
        """The user chose a process that belongs to a gpuopt-tui run (Enter on its row)."""

        def __init__(self, run_id: str) -> None:
            super().__init__()
            self.run_id = run_id

    def __init__(
        self,
        source: TelemetrySource,
        interval: float = 1.0,
        history: History | None = None,
        readonly: bool = False,
        *,
        id: str | None = None,
    ) -> None:
        super().__init__(id=id)
        self.source = source
        self.interval = interval
        self.history = history if history is not None else History()
        self.readonly = readonly or not source.live
        self.selected = 0
        self.snapshot: Snapshot | None = None

    def compose(self) -> ComposeResult:
        yield GpuPoller(self.source, self.interval)
        yield OneLine(id="gpu-title")
        yield OneLine("Reading GPUs…", id="gpu-message")
        yield GpuRows()
        with Horizontal(id="gpu-detail"):
            yield TextLines(id="gpu-fields")
            with Vertical(id="gpu-plots"):
                yield OneLine(classes="plot-label", id="label-memory")
                yield HistoryPlot("memory", "magenta", id="plot-memory")
                yield OneLine(classes="plot-label", id="label-util")
                yield HistoryPlot("util", "cyan", id="plot-util")
        yield OneLine(id="gpu-note")
        yield OneLine(_HEADER, id="process-header")
        yield ProcessList(id="gpu-processes")

    def on_mount(self) -> None:
        self.query_one("#gpu-detail").display = False
        self.query_one("#gpu-note").display = False
        self._set_title(None)

    def wake(self) -> None:
        """Call when the view is shown again: polls at once if polls were skipped while it was hidden."""
        self.query_one(GpuPoller).wake()

    def _set_title(self, snapshot: Snapshot | None) -> None:
        parts = ["GPUs", self.source.label, f"every {self.interval:g} s"]
        if snapshot is not None and snapshot.has_gpus:
            parts.append(process_summary(snapshot))
        if self.readonly:
            parts.append("read-only")
        self.query_one("#gpu-title", OneLine).set_text(" · ".join(parts))

    # -- drawing -------------------------------------------------------------------------------------------
    def on_gpu_poller_polled(self, message: GpuPoller.Polled) -> None:
        message.stop()
        self.apply(message.snapshot)

    def apply(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self.history.add(snapshot)
        has_gpus = snapshot.has_gpus
        with self.app.batch_update():
            self._set_title(snapshot)
            message = self.query_one("#gpu-message", OneLine)
            message.display = not has_gpus
            if not has_gpus:
                message.set_text(no_gpu_text(snapshot))
            rows = self.query_one(GpuRows)
            rows.display = len(snapshot.gpus) > 1  # a list to choose from; one GPU's line would repeat its details
            rows.show(snapshot.gpus)
            if has_gpus and self.selected >= len(snapshot.gpus):
                self.selected = 0
            rows.select(self.selected if has_gpus else None)
            self.query_one("#gpu-detail").display = has_gpus
            if has_gpus:
                self._show_selected()
            note = self.query_one("#gpu-note", OneLine)
            note.display = bool(snapshot.notes)
            note.set_text(" · ".join(snapshot.notes))
            self.query_one("#process-header").display = has_gpus
            processes = self.query_one(ProcessList)
            processes.display = has_gpus
            processes.show(snapshot.processes)

    def _show_selected(self) -> None:
        if self.snapshot is None or not self.snapshot.has_gpus:
            return
        gpu = self.snapshot.gpus[self.selected]
        self.query_one("#gpu-fields", TextLines).set_lines(detail_text(gpu).split("\n"))
        plot = self.query_one("#plot-util", HistoryPlot)
        column = self.history.window_s / max(1, plot.size.width)
        span = f"{self.history.window_s / 60:g} min sweep · {column:.2g} s/col"
        total = "" if gpu.memory_total is None else f" of {display.gib(gpu.memory_total)} GiB"
        self.query_one("#label-memory", OneLine).set_text(f"Memory %{total} · {span}")
        self.query_one("#label-util", OneLine).set_text(f"SM util % · {span}")
        for plot in self.query(HistoryPlot):
            plot.show(self.history, gpu.index)

    def on_resize(self) -> None:
        self._show_selected()  # the plots' width sets how long a column lasts, which their labels say

    # -- GPU selection -------------------------------------------------------------------------------------
    def action_select_gpu(self, step: int) -> None:
        if self.snapshot is not None and self.snapshot.has_gpus:
            self._select((self.selected + step) % len(self.snapshot.gpus))

    def action_jump_gpu(self, index: int) -> None:
        if self.snapshot is not None and index < len(self.snapshot.gpus):
            self._select(index)

    def select(self, index: int) -> None:
        """Show GPU `index`; before the first snapshot, from that snapshot on."""
        if self.snapshot is None:
            self.selected = index
        else:
            self.action_jump_gpu(index)

    def _select(self, index: int) -> None:
        self.selected = index
        self.query_one(GpuRows).select(index)
        self._show_selected()

    def on_gpu_row_clicked(self, message: GpuRow.Clicked) -> None:
        message.stop()
        self.action_jump_gpu(message.index)

    # -- processes -----------------------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "signal":
            return not self.readonly
        return True

    def action_signal(self, name: str) -> None:
        process = self.query_one(ProcessList).highlighted()
        if process is None:
            self.notify("Select a process first", severity="warning")
            return
        started = start_time(process.pid)
        what = process.command or "?"
        run = f" (run {process.run_id})" if process.run_id else ""
        question = f"Send {name} to process {process.pid}{run}?\n{what}\nuser {process.user or '?'}"

        def answer(confirmed: bool | None) -> None:
            if not confirmed:
                return
            try:
                send_signal(process.pid, name, started)
            except UserError as error:
                self.notify(str(error), title=f"{name} not sent", severity="error")
            else:
                self.notify(f"Sent {name} to process {process.pid}")

        self.app.push_screen(ConfirmDialog(question, yes=f"Send {name}", no="Cancel"), answer)

    def on_process_list_chosen(self, message: ProcessList.Chosen) -> None:
        message.stop()
        if message.process.run_id:
            self.post_message(self.RunRequested(message.process.run_id))
