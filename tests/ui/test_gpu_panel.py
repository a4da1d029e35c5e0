"""The GPU panel and GPU screen driven by replayed traces: Pilot tests and SVG snapshots.

Real-looking pictures come from h200_ig_bench.jsonl, NVML samples recorded on an NVIDIA H200 while the IG
benchmark ran; the synthetic trace covers what a real one rarely shows (N/A fields, a lost GPU, several GPUs,
a process of a gpuopt-tui run)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from textual.app import App, ComposeResult
from textual.pilot import Pilot
from textual.screen import Screen
from textual.widgets import Static

from gpuopt_tui.app import make_app
from gpuopt_tui.core.telemetry import (
    GpuSample,
    NoGpuSource,
    ProcessSample,
    ReplaySource,
    Snapshot,
    TraceWriter,
    display,
    read_trace,
)
from gpuopt_tui.ui.gpu_monitor import GpuMonitorApp, GpuMonitorScreen
from gpuopt_tui.ui.gpu_poller import GpuPoller
from gpuopt_tui.ui.gpu_telemetry import GpuTelemetry, busiest_sample
from gpuopt_tui.ui.partial_updates import CroppingCompositor
from gpuopt_tui.ui.screens.gpu import GpuScreen
from gpuopt_tui.ui.screens.registry import SCREENS
from gpuopt_tui.ui.screens.runs import RunsScreen
from gpuopt_tui.ui.widgets.confirm import ConfirmDialog
from gpuopt_tui.ui.widgets.gpu_panel import GpuPanel, GpuRow, GpuRows, gpu_line
from gpuopt_tui.ui.widgets.gpu_view import GpuView, ProcessList
from gpuopt_tui.ui.widgets.history_plot import HistoryPlot, plot_text

from .conftest import TickCounter, make_run, wait_for

TRACES = Path(__file__).parents[1] / "fixtures" / "traces"
SYNTHETIC = TRACES / "synthetic_3gpu.jsonl"
H200 = TRACES / "h200_ig_bench.jsonl"
BUSY = busiest_sample(read_trace(H200))  # the benchmark's largest batch
NO_DRIVER = "no NVIDIA driver found (libnvidia-ml.so.1 is not installed)"
SLOW = 3600.0  # an interval so long that only the poll at mount happens: a deterministic frame
GIB = 1024**3


def screen_text(app: App) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


def shown_line(row: GpuRow) -> str:
    return row.content_lines(row.size)[0].plain


def replay_at(frame: int, loop: bool = True) -> ReplaySource:
    """The synthetic trace, advanced so that its next poll returns sample `frame`."""
    source = ReplaySource(SYNTHETIC, speed=None, loop=loop)
    for _ in range(frame):
        source.poll()
    return source


def h200_still(frame: int = BUSY) -> GpuTelemetry:
    """Every poll returns sample `frame` of the H200 trace; the history holds the samples before it."""
    return GpuTelemetry.from_trace(H200, start=frame, stop=frame + 1, speed=None, loop=False)


class PanelApp(App):
    def __init__(self, panel: GpuPanel) -> None:
        super().__init__()
        self.panel = panel

        self.selected: list[int] = []

    def compose(self) -> ComposeResult:
        yield self.panel
        yield Static("the rest of the dashboard")

    def on_gpu_panel_selected(self, message: GpuPanel.Selected) -> None:
        self.selected.append(message.index)


# --- the panel ------------------------------------------------------------------------------------------------


async def test_the_panel_has_a_line_per_gpu_from_the_replayed_trace() -> None:
    panel = GpuPanel(replay_at(0), interval=SLOW)
    app = PanelApp(panel)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: panel.snapshot is not None and len(panel.query(GpuRow)) == 3)
        await pilot.pause()
        lines = [shown_line(row) for row in panel.query(GpuRow)]
        assert lines[0].startswith("0 Synthetic GPU A 80GB") and "2.0/80.0G" in lines[0]
        assert "48%" in lines[0] and "35°C" in lines[0] and "360/700W" in lines[0]
        assert lines[1].split()[-2:] == ["N/A", "N/A"]  # temperature and power not reported by that card
        assert panel.border_subtitle == "4 processes · 1 run"
        assert "replay of synthetic_3gpu.jsonl" in str(panel.border_title)
        assert not panel.query_one("#gpu-message").display
        await pilot.click(GpuRow, offset=(5, 0))
        await wait_for(pilot, lambda: app.selected == [0])


def shown(gpu: GpuSample) -> list[str]:
    """The figures a panel line ends with: memory, SM utilisation, temperature, power."""
    power = display.power(gpu.power_draw, gpu.power_limit)
    return [display.memory(gpu, compact=True), f"{gpu.util_sm}%", display.temperature(gpu.temperature), power]


async def test_the_panel_shows_the_recorded_h200() -> None:
    panel = GpuPanel(h200_still().source, interval=SLOW)
    async with PanelApp(panel).run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: len(panel.query(GpuRow)) == 1)
        await pilot.pause()
        line = shown_line(panel.query_one(GpuRow))
        gpu = read_trace(H200).snapshots[BUSY].gpus[0]
        assert line.startswith("0 H200 ███") and line.split()[-4:] == shown(gpu)
        assert shown(gpu)[0].endswith("/140.4G")  # an H200's 141 GB
        assert panel.border_subtitle == "1 process"
        assert "replay of h200_ig_bench.jsonl" in str(panel.border_title)


async def test_a_lost_gpu_is_shown_as_lost() -> None:
    frames = read_trace(SYNTHETIC).snapshots
    lost_from = next(i for i, f in enumerate(frames) if f.gpus[2].lost)
    panel = GpuPanel(replay_at(lost_from), interval=SLOW)
    async with PanelApp(panel).run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: len(panel.query(GpuRow)) == 3)
        await pilot.pause()
        text = screen_text(pilot.app)
        assert "2 Synthetic GPU C 80GB GPU LOST: reset it or reboot" in text
        assert "0 Synthetic GPU A 80GB" in text and "3 processes" in text


async def test_no_driver_is_one_line_and_the_rest_works() -> None:
    panel = GpuPanel(NoGpuSource(NO_DRIVER), interval=SLOW)
    async with PanelApp(panel).run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: panel.snapshot is not None)
        await pilot.pause()
        text = screen_text(pilot.app)
        assert f"No GPU: {NO_DRIVER}" in text
        assert len([line for line in text.splitlines() if "No GPU" in line]) == 1
        assert not panel.query(GpuRow) and panel.border_subtitle == ""
        assert "the rest of the dashboard" in text


def eight_gpu_trace(path: Path) -> Path:
    gpus = tuple(
        GpuSample(
            index=i,
            name="NVIDIA H100 80GB HBM3",
            memory_used=(10 * i + 1) * GIB,
            memory_total=80 * GIB,
            util_sm=12 * i,
            temperature=40 + i,
            power_draw=100.0 + 70 * i,
            power_limit=700.0,
        )
        for i in range(8)
    )
    processes = tuple(ProcessSample(pid=1000 + i, gpu_index=i, gpu_memory=GIB, user="u", command="x") for i in range(8))
    with TraceWriter(path, {"interval": 1.0, "synthetic": True}) as trace:
        trace.write(Snapshot(time=1.0, gpus=gpus, processes=processes))
    return path


async def test_eight_gpus_are_legible_at_100x30(tmp_path: Path) -> None:
    trace = eight_gpu_trace(tmp_path / "synthetic_8gpu.jsonl")
    panel = GpuPanel(ReplaySource(trace, speed=None), interval=SLOW)
    async with PanelApp(panel).run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: len(panel.query(GpuRow)) == 8)
        await pilot.pause()
        text = screen_text(pilot.app)
        for i in range(8):
            line = next(line for line in text.splitlines() if f"│ {i} H100 80GB HBM3" in line)
            assert f"{10 * i + 1:.1f}/80.0G" in line and f"{12 * i}%" in line
            assert f"{40 + i}°C" in line and f"{100 + 70 * i}/700W" in line
    app = GpuMonitorApp(ReplaySource(trace, speed=None), interval=SLOW)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: len(pilot.app.screen.query(GpuRow)) == 8)
        await pilot.pause()
        text = screen_text(pilot.app)
        assert all(f"{i} H100 80GB HBM3" in text for i in range(8))
        assert "Memory  1.0/80.0 GiB" in text and "PID" in text and "1000" in text


@pytest.mark.parametrize("width", [100, 70, 48, 40, 32])
def test_a_gpu_line_fits_its_width_and_keeps_memory_and_util(width: int) -> None:
    gpu = read_trace(H200).snapshots[BUSY].gpus[0]
    line = gpu_line(gpu, width)
    memory, util, _, power = shown(gpu)
    assert line.cell_len <= width
    assert memory in line.plain and util in line.plain
    assert (power in line.plain) == (width >= 48)


def test_a_row_is_redrawn_only_when_what_it_shows_changes() -> None:
    first = read_trace(H200).snapshots[BUSY].gpus[0]
    row = GpuRow(first)
    redraws: list[object] = []
    row.refresh = lambda *a, **k: redraws.append(1)  # type: ignore[method-assign]
    row.show(GpuSample(**{**first.to_dict(), "pcie_rx": 99, "clock_sm": 1, "power_draw": first.power_draw + 0.2}))
    assert redraws == []
    row.show(GpuSample(**{**first.to_dict(), "util_sm": 99}))
    assert redraws == [1]


# --- polling --------------------------------------------------------------------------------------------------


class CountingSource:
    """Wraps a source; counts polls and fails the test if two ever overlap."""

    live = False
    label = "counting"

    def __init__(self, inner: ReplaySource) -> None:
        self.inner = inner
        self.polls = 0
        self.overlaps = 0
        self._busy = threading.Lock()

    def poll(self) -> Snapshot:
        if not self._busy.acquire(blocking=False):
            self.overlaps += 1
            return self.inner.poll()
        try:
            time.sleep(0.05)
            self.polls += 1
            return self.inner.poll()
        finally:
            self._busy.release()

    def close(self) -> None:
        pass


async def test_polls_never_overlap_and_stop_while_the_panel_is_hidden() -> None:
    source = CountingSource(replay_at(0))
    panel = GpuPanel(source, interval=0.25)
    async with PanelApp(panel).run_test(size=(100, 30)) as pilot:
        poller = panel.query_one(GpuPoller)
        ticks = TickCounter(poller)

        async def polls_before_two_skipped_ticks() -> int:
            """Once a tick has been skipped (ticks are armed only after a poll has landed, so none is in flight),
            the polls so far; returns after two more ticks."""
            await wait_for(pilot, lambda: poller._missed)
            polls = source.polls
            await ticks.wait(pilot, 2)
            return polls

        await wait_for(pilot, lambda: source.polls >= 3)
        panel.display = False
        hidden = await polls_before_two_skipped_ticks()
        assert source.polls == hidden
        panel.display = True
        await wait_for(pilot, lambda: source.polls >= hidden + 2)
        pilot.app.push_screen(Screen())  # another screen on top: the panel's screen is not current
        covered = await polls_before_two_skipped_ticks()
        assert source.polls == covered
        pilot.app.pop_screen()
        await wait_for(pilot, lambda: source.polls >= covered + 2)
    assert source.overlaps == 0


async def test_the_interval_below_the_minimum_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 0.25 s"):
        GpuPoller(NoGpuSource("x"), interval=0.1)


# --- the GPU screen -------------------------------------------------------------------------------------------


async def test_the_gpu_screen_shows_details_history_and_processes() -> None:
    telemetry = GpuTelemetry.from_trace(H200, start=BUSY - 4, speed=None)  # one sample a poll from there on
    app = GpuMonitorApp(telemetry.source, interval=0.25)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = pilot.app.screen
        assert isinstance(screen, GpuMonitorScreen) and isinstance(screen._compositor, CroppingCompositor)
        plots = list(screen.query(HistoryPlot))
        # a plot shows complete columns only: the first one completes within a column's length of trace time
        await wait_for(pilot, lambda: all(any(v is not None for v in plot.values) for plot in plots))
        await pilot.pause()
        text = screen_text(pilot.app)
        first = read_trace(H200).snapshots[BUSY - 4]
        assert "GPU 0  NVIDIA H200" in text and f"UUID    {first.gpus[0].uuid}" in text
        assert "/140.4 GiB" in text and "MIG off" in text and "fan N/A" in text and "memory 3201 MHz" in text
        assert "read-only" in text  # a replay's pids belong to another machine
        assert not screen.query_one(GpuRows).display  # one GPU: no list to choose from, its details say it all
        table = screen.query_one(ProcessList)
        assert [(p.pid, p.user) for p in table.processes.values()] == [(first.processes[0].pid, "user1")]
        assert "python3 benchmarks/ig_bench.py" in text


async def test_gpus_are_chosen_with_brackets_and_digits() -> None:
    app = GpuMonitorApp(replay_at(0), interval=SLOW)
    async with app.run_test(size=(100, 30)) as pilot:
        screen = pilot.app.screen
        await wait_for(pilot, lambda: screen.view.snapshot is not None)
        await pilot.pause()
        assert "GPU 0  Synthetic GPU A 80GB" in screen_text(pilot.app)
        assert screen.query_one(GpuRows).display  # several GPUs: a line each to choose from
        await pilot.press("right_square_bracket")
        assert screen.view.selected == 1
        assert "GPU 1  Synthetic GPU B 80GB" in screen_text(pilot.app)
        await pilot.press("2")
        assert screen.view.selected == 2


async def test_the_process_table_follows_processes_that_come_and_go() -> None:
    frames = read_trace(SYNTHETIC).snapshots
    lost_from = next(i for i, f in enumerate(frames) if f.gpus[2].lost)
    app = GpuMonitorApp(replay_at(lost_from - 2), interval=0.25)
    async with app.run_test(size=(100, 30)) as pilot:
        table = pilot.app.screen.query_one(ProcessList)
        await wait_for(pilot, lambda: 7171 in {p.pid for p in table.processes.values()})
        await wait_for(pilot, lambda: 7171 not in {p.pid for p in table.processes.values()})
        assert len(table.processes) == 3
        assert "GPU LOST" in screen_text(pilot.app)


def test_plot_columns_use_a_fixed_0_to_100_scale() -> None:
    lines = plot_text([None, 0.0, 50.0, 100.0], height=2, style="").plain.splitlines()
    assert lines == ["   █", " ▁██"]  # no sample: blank; zero: a dim baseline; 50%: half the height
    assert plot_text([100.0, 100.0], height=3, style="").plain.splitlines() == ["██", "██", "██"]


class LiveSource:
    """One GPU with one real process of this user, as live NVML would report it."""

    live = True
    label = "test"

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> Snapshot:
        gpu = GpuSample(index=0, name="card", memory_used=GIB, memory_total=8 * GIB, util_sm=5)
        process = ProcessSample(pid=self.pid, gpu_index=0, gpu_memory=GIB, user="me", command="sleep 30")
        return Snapshot(time=time.time(), gpus=(gpu,), processes=(process,))

    def close(self) -> None:
        pass


class ScreenApp(App):
    def __init__(self, screen: GpuMonitorScreen) -> None:
        super().__init__()
        self.gpu_screen = screen
        self.runs_requested: list[str] = []

    def on_mount(self) -> None:
        self.push_screen(self.gpu_screen)

    def on_gpu_view_run_requested(self, message: GpuView.RunRequested) -> None:
        self.runs_requested.append(message.run_id)


async def test_a_process_is_signalled_only_after_confirmation() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        screen = GpuMonitorScreen(GpuView(LiveSource(child.pid), interval=SLOW))
        async with ScreenApp(screen).run_test(size=(100, 30)) as pilot:
            table = screen.query_one(ProcessList)
            await wait_for(pilot, lambda: len(table.processes) == 1)
            table.focus()
            await pilot.press("T")
            await wait_for(pilot, lambda: isinstance(pilot.app.screen, ConfirmDialog))
            await pilot.press("n")
            await wait_for(pilot, lambda: pilot.app.screen is screen)
            assert child.poll() is None
            await pilot.press("T")
            await wait_for(pilot, lambda: isinstance(pilot.app.screen, ConfirmDialog))
            await pilot.press("y")
            await wait_for(pilot, lambda: pilot.app.screen is screen)
            assert child.wait(timeout=5) == -15
            await pilot.press("escape")  # pushed screens can be closed
            await wait_for(pilot, lambda: pilot.app.screen is not screen)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


async def test_read_only_turns_signals_off() -> None:
    screen = GpuMonitorScreen(GpuView(LiveSource(os.getpid()), interval=SLOW, readonly=True))
    async with ScreenApp(screen).run_test(size=(100, 30)) as pilot:
        table = screen.query_one(ProcessList)
        await wait_for(pilot, lambda: len(table.processes) == 1)
        table.focus()
        for key in ("I", "T", "K"):
            await pilot.press(key)
            await pilot.pause()
            assert pilot.app.screen is screen
        assert screen.view.check_action("signal", ("SIGTERM",)) is False
        assert "SIGTERM" not in screen_text(pilot.app)  # not offered in the footer


async def test_enter_on_a_process_of_a_run_asks_for_the_run() -> None:
    screen = GpuMonitorScreen(GpuView(replay_at(0), interval=SLOW))
    app = ScreenApp(screen)
    async with app.run_test(size=(100, 30)) as pilot:
        table = screen.query_one(ProcessList)
        await wait_for(pilot, lambda: len(table.processes) == 4)
        table.focus()
        table.move_to("0:4242")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.runs_requested == ["20261126-101500-ig"])


# --- in the app -----------------------------------------------------------------------------------------------


def footer_line(app: App) -> str:
    return screen_text(app).splitlines()[-1]


async def test_the_apps_gpu_screen_has_the_navigation_bar_and_leaves_the_screen_keys_alone() -> None:
    app = make_app(screen="gpu", telemetry=h200_still())
    async with app.run_test(size=(100, 30)) as pilot:
        screen = app.screen
        assert isinstance(screen, GpuScreen)
        assert isinstance(screen._compositor, CroppingCompositor)  # sends only the cells that change
        await wait_for(pilot, lambda: screen.view.snapshot is not None)
        await pilot.pause()
        lines = screen_text(app).splitlines()
        assert all(s.label in lines[0] for s in SCREENS), lines[0]
        assert "GPU 0  NVIDIA H200" in screen_text(app)
        assert "Next GPU" in footer_line(app) and "SIGTERM" not in footer_line(app)  # a replay is read-only
        await pilot.press("t")  # the TracIn key, not a signal
        assert app.current_mode == "tracin"
        await pilot.press("g")
        assert app.screen is screen


async def test_the_replay_option_plays_the_h200_trace_on_the_panel_and_the_screen() -> None:
    app = make_app(replay=H200)  # what `gpuopt-tui --replay FILE` runs
    async with app.run_test(size=(120, 40)) as pilot:
        panel = app.screen.query_one(GpuPanel)
        await wait_for(pilot, lambda: panel.snapshot is not None)
        assert panel.snapshot.gpus[0].name == "NVIDIA H200" and "replay of h200_ig_bench.jsonl" in str(
            panel.border_title
        )
        await pilot.press("g")
        view = app.screen.query_one(GpuView)
        await wait_for(pilot, lambda: view.snapshot is not None)
        await pilot.pause()
        assert "GPU 0  NVIDIA H200" in screen_text(app) and "read-only" in screen_text(app)
        assert view.history is panel.history  # the screen's plots go on from what the panel saw


async def test_the_panel_opens_the_gpu_screen_on_the_gpu_clicked() -> None:
    app = make_app(telemetry=GpuTelemetry(replay_at(len(read_trace(SYNTHETIC).snapshots) - 1, loop=False)))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: len(app.screen.query(GpuRow)) == 3)
        await pilot.pause()
        row = list(app.screen.query(GpuRow))[1]
        await pilot.click(row, offset=(5, 0))
        await wait_for(pilot, lambda: app.current_mode == "gpu")
        view = app.screen.query_one(GpuView)
        await wait_for(pilot, lambda: view.snapshot is not None and view.selected == 1)
        await pilot.pause()
        assert "GPU 1  Synthetic GPU B 80GB" in screen_text(app)


class RunProcessSource(LiveSource):
    """A live GPU with one process that belongs to a run."""

    def __init__(self, pid: int, run_id: str) -> None:
        super().__init__(pid)
        self.run_id = run_id

    def poll(self) -> Snapshot:
        snapshot = super().poll()
        return Snapshot(
            time=snapshot.time, gpus=snapshot.gpus, processes=(replace(snapshot.processes[0], run_id=self.run_id),)
        )


async def test_a_process_of_a_run_opens_that_run_and_signals_ask_first(runs_root: Path) -> None:
    runs = [make_run(runs_root, ("started", {"pid": 1, "attempt": 1}), ("failed", {"message": m})) for m in "ab"]
    wanted = runs[0].name  # the older run: not the row the runs screen selects anyway
    child = subprocess.Popen(["sleep", "30"])
    try:
        app = make_app(screen="gpu", telemetry=GpuTelemetry(RunProcessSource(child.pid, wanted)))
        async with app.run_test(size=(120, 40)) as pilot:
            table = app.screen.query_one(ProcessList)
            await wait_for(pilot, lambda: len(table.processes) == 1 and len(app.runs.runs) == 2)
            table.focus()
            assert "SIGTERM" in footer_line(app)
            await pilot.press("T")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog))
            await pilot.press("n")
            await wait_for(pilot, lambda: isinstance(app.screen, GpuScreen))
            assert child.poll() is None
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.current_mode == "runs")
            screen = app.screen
            assert isinstance(screen, RunsScreen)
            await wait_for(pilot, lambda: screen.table.selected_id == wanted)
    finally:
        child.kill()
        child.wait()


# --- snapshots ------------------------------------------------------------------------------------------------


def at_the_end() -> ReplaySource:
    """The trace's last sample on every poll (same time: history ignores the repeats): a still frame."""
    return replay_at(len(read_trace(SYNTHETIC).snapshots) - 1, loop=False)


async def _first_poll(pilot: Pilot) -> None:
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


def test_snapshot_panel(snap_compare) -> None:
    panel = GpuPanel(h200_still().source)
    assert snap_compare(PanelApp(panel), terminal_size=(100, 30), run_before=_first_poll)


def test_snapshot_panel_of_the_synthetic_trace(snap_compare) -> None:
    """N/A fields and a lost GPU."""
    assert snap_compare(PanelApp(GpuPanel(at_the_end())), terminal_size=(100, 30), run_before=_first_poll)


def test_snapshot_panel_without_a_driver(snap_compare) -> None:
    panel = GpuPanel(NoGpuSource(NO_DRIVER))
    assert snap_compare(PanelApp(panel), terminal_size=(100, 30), run_before=_first_poll)


def test_snapshot_gpu_screen(snap_compare) -> None:
    telemetry = h200_still()
    screen = GpuMonitorScreen(GpuView(telemetry.source, history=telemetry.history))
    assert snap_compare(ScreenApp(screen), terminal_size=(100, 30), run_before=_first_poll)
