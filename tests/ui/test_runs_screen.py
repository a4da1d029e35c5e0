"""The runs screen and the run poller, on real run directories: failed runs explain themselves, damaged or
vanished runs give clear messages, and cancel / resume / delete ask first and keep the app running."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from itertools import pairwise
from pathlib import Path

from rich.text import Text
from textual.widgets import Log

from gpuopt_tui.app import make_app
from gpuopt_tui.core.runs.events import EventWriter
from gpuopt_tui.core.runs.status import RunInfo
from gpuopt_tui.core.telemetry import GpuSample, ProcessSample, ReplaySource, Snapshot
from gpuopt_tui.ui.gpu_telemetry import GpuTelemetry
from gpuopt_tui.ui.run_poller import IDLE_INTERVAL_S, RunsPolled
from gpuopt_tui.ui.screens.results import ResultsScreen
from gpuopt_tui.ui.screens.runs import RunsScreen
from gpuopt_tui.ui.widgets.confirm import ConfirmDialog
from gpuopt_tui.ui.widgets.log_view import LogScreen
from gpuopt_tui.ui.widgets.run_progress import RunGpuPoller
from gpuopt_tui.ui.widgets.run_text import activity_text, elapsed_seconds
from gpuopt_tui.ui.widgets.runs_table import RunsTable

from .conftest import flat_text, make_run, notifications, wait_for, widget_text

TRACE = Path(__file__).parents[1] / "fixtures" / "traces" / "h200_ig_bench.jsonl"
FAILED_LOG = "[info] loading\nTraceback (most recent call last):\nValueError: shapes do not match\n"


def table_cell(app: object, run_id: str, column: str) -> str:
    table = app.screen.query_one("#runs-table", RunsTable)  # type: ignore[attr-defined]
    value = table.get_cell(run_id, column)
    return value.plain if isinstance(value, Text) else str(value)


def log_lines(app: object, selector: str) -> list[str]:
    return list(app.screen.query_one(selector, Log).lines)  # type: ignore[attr-defined]


async def test_failed_run_shows_its_message_and_log(runs_root: Path) -> None:
    run_dir = make_run(
        runs_root,
        ("started", {"pid": 1, "attempt": 1}),
        ("failed", {"message": "ValueError: shapes do not match (traceback in log.txt)"}),
        log=FAILED_LOG,
    )
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.runs.get(run_dir.name) is not None)
        await pilot.pause()
        assert table_cell(app, run_dir.name, "status") == "failed"
        assert "shapes do not match" in widget_text(app, "#detail-progress")
        assert "ValueError: shapes do not match" in log_lines(app, "#detail-log")
        await pilot.press("a")  # the kind screen shows the same failure with the log tail
        await pilot.pause()
        assert "shapes do not match" in widget_text(app, "#run-progress")
        assert "End of log.txt" in widget_text(app, "#results-text")
        assert "ValueError: shapes do not match" in log_lines(app, "#results-log")


async def test_corrupt_events_are_skipped_and_counted(runs_root: Path) -> None:
    run_dir = make_run(runs_root, ("started", {"pid": 1, "attempt": 1}))
    with (run_dir / "events.jsonl").open("a", encoding="utf-8") as f:
        f.write("{not json}\n")
        f.write('{"t": 1, "type": "progress", "done": 3, "total": 10}\n')
        f.write('{"t": 2, "type": "progr')  # a line cut off mid-write
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.runs.get(run_dir.name) is not None)
        await pilot.pause()
        assert table_cell(app, run_dir.name, "status") == "crashed"  # no process behind it
        assert table_cell(app, run_dir.name, "progress") == "3/10 (30%)"
        assert "1 unreadable line(s) in events.jsonl were skipped" in widget_text(app, "#detail-progress")


async def test_damaged_runs_are_listed_with_the_reason_beside_the_others(runs_root: Path) -> None:
    good = make_run(runs_root, ("started", {"pid": 1, "attempt": 1}), ("finished", {"summary": {}}))
    far = make_run(runs_root, ("started", {"pid": 1, "attempt": 1}), ("finished", {"summary": {}}))
    bad = make_run(runs_root)
    for run_dir, created in ((bad, None), (far, 1e300)):
        meta = json.loads((run_dir / "meta.json").read_text())
        (run_dir / "meta.json").write_text(json.dumps({**meta, "created": created}))
    app = make_app(screen="runs")
    async with app.run_test(size=(160, 40)) as pilot:
        await wait_for(pilot, lambda: all(app.runs.get(r.name) for r in (good, far, bad)))
        await pilot.pause()
        assert [table_cell(app, r.name, "status") for r in (good, far, bad)] == ["finished", "finished", "damaged"]
        assert table_cell(app, far.name, "created") == "?"
        assert table_cell(app, bad.name, "message").startswith("meta.json: 'created' is null")
        assert not notifications(app)


async def test_run_directory_deleted_while_listed(runs_root: Path) -> None:
    run_dir = make_run(runs_root, ("started", {"pid": 1, "attempt": 1}), ("cancelled", {"message": "by request"}))
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.runs.get(run_dir.name) is not None)
        app.poller._timer.stop()  # hold the next poll so the deleted run is still listed
        shutil.rmtree(run_dir)
        await pilot.press("l")
        assert any("no longer exists" in n for n in notifications(app))
        assert not isinstance(app.screen, LogScreen)
        await wait_for(pilot, lambda: app.runs.get(run_dir.name) is None)
        await pilot.pause()
        assert app.screen.query_one("#runs-table", RunsTable).row_count == 0
        assert f"No runs yet in {runs_root}" in flat_text(app)


async def test_cancel_asks_then_signals_the_process_group(live_run: tuple[Path, subprocess.Popen[bytes]]) -> None:
    run_dir, proc = live_run
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: (info := app.runs.get(run_dir.name)) is not None and info.active)
        await pilot.pause()
        assert table_cell(app, run_dir.name, "status") == "running"
        await pilot.press("c")
        assert isinstance(app.screen, ConfirmDialog)
        await pilot.press("n")
        assert proc.poll() is None  # "no" leaves it running
        await pilot.press("c")
        await pilot.press("y")
        proc.wait(timeout=10)
        assert proc.returncode == -signal.SIGTERM
        await wait_for(pilot, lambda: table_cell(app, run_dir.name, "status") == "crashed")
        assert any("cancelling" in n for n in notifications(app))


async def test_resume_with_an_unreadable_frozen_profile_says_why(runs_root: Path) -> None:
    run_dir = make_run(runs_root, ("started", {"pid": 1, "attempt": 1}), ("failed", {"message": "boom"}))
    (run_dir / "profile.toml").write_text("kind = [", encoding="utf-8")
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.runs.get(run_dir.name) is not None)
        await pilot.pause()
        await pilot.press("s")
        await pilot.pause()
        assert any("profile.toml" in n and "not valid TOML" in n for n in notifications(app))
        assert app.is_running


async def test_delete_asks_first(runs_root: Path) -> None:
    run_dir = make_run(runs_root, ("started", {"pid": 1, "attempt": 1}), ("failed", {"message": "boom"}))
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.runs.get(run_dir.name) is not None)
        await pilot.pause()
        await pilot.press("x", "n")
        assert run_dir.exists()
        await pilot.press("x", "y")
        assert not run_dir.exists()
        await wait_for(pilot, lambda: app.runs.get(run_dir.name) is None)


async def test_log_viewer_and_dashboard_open_the_selected_run(runs_root: Path) -> None:
    for message in ("first", "second"):
        run_dir = make_run(runs_root, ("started", {"pid": 1, "attempt": 1}), ("failed", {"message": message}))
        (run_dir / "log.txt").write_text(f"the log of {run_dir.name}\n", encoding="utf-8")
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: len(app.runs.runs) == 2)
        await pilot.pause()
        second_row = app.runs.runs[1].id
        await pilot.press("tab", "down", "enter")  # the dashboard's table: the second run's results
        await wait_for(pilot, lambda: isinstance(app.screen, ResultsScreen) and app.screen.run_id == second_row)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, ResultsScreen))
        table = app.screen.query_one(RunsTable)
        await pilot.click(table, offset=(2, 2))  # a click on its row: the run in the Runs screen
        await wait_for(pilot, lambda: app.current_mode == "runs")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, RunsScreen)
        assert screen.table.selected_id == second_row
        await pilot.press("l")
        assert isinstance(app.screen, LogScreen)
        await pilot.pause()
        assert f"the log of {second_row}" in log_lines(app, "#log-full")
        await pilot.press("escape")
        assert app.screen is screen


async def test_idle_polls_redraw_nothing(runs_root: Path) -> None:
    make_run(runs_root, ("started", {"pid": 1, "attempt": 1}), ("finished", {"summary": {}}))
    polls: list[RunsPolled] = []
    app = make_app(screen="runs")
    hook = lambda message: polls.append(message) if isinstance(message, RunsPolled) else None  # noqa: E731
    async with app.run_test(size=(120, 40), message_hook=hook) as pilot:
        await wait_for(pilot, lambda: len(app.runs.runs) == 1)
        screen = app.screen
        updates: list[object] = []
        screen.runs_updated = updates.append  # type: ignore[method-assign]
        seen = len(polls)
        await wait_for(pilot, lambda: len(polls) >= seen + 3)
        idle = polls[seen:]
        gaps = [b.time - a.time for a, b in pairwise(idle)]
        assert min(gaps) >= IDLE_INTERVAL_S * 0.99  # one poll a second while no run is active, never two at once
        assert not any(p.changed for p in idle)
        assert updates == []  # nothing changed, so nothing was redrawn


GIB = 1024**3


class RunGpuSource:
    """Live NVML as it would report a run's process: `pid` holds `used` bytes on GPU 0. Counts its polls."""

    live = True
    label = "test"

    def __init__(self, pid: int, used: int) -> None:
        self.pid = pid
        self.used = used
        self.polls = 0

    def poll(self) -> Snapshot:
        self.polls += 1
        gpu = GpuSample(index=0, name="card", memory_used=self.used, memory_total=80 * GIB, util_sm=90)
        process = ProcessSample(pid=self.pid, gpu_index=0, gpu_memory=self.used, user="me", command="python -m job")
        return Snapshot(time=time.time(), gpus=(gpu,), processes=(process,))

    def close(self) -> None:
        pass


async def test_a_runs_torch_memory_is_shown_beside_nvmls_figure(live_run: tuple[Path, subprocess.Popen[bytes]]) -> None:
    run_dir, proc = live_run
    writer = EventWriter(run_dir / "events.jsonl")
    writer.progress(force=True, done=2, total=8, gpu_allocated=GIB, gpu_reserved=2 * GIB, gpu_peak=3 * GIB // 2)
    writer.close()
    source = RunGpuSource(proc.pid, 2 * GIB + 512 * 2**20)
    app = make_app(screen="runs", telemetry=GpuTelemetry(source))
    async with app.run_test(size=(120, 40)) as pilot:
        nvml = f"GPU memory (NVML): 2.5 GiB · pid {proc.pid} on GPU 0 · 512.0 MiB outside torch's pool"
        await wait_for(pilot, lambda: nvml in widget_text(app, "#detail-progress"))
        assert "GPU memory (torch): allocated 1.0 GiB · reserved 2.0 GiB · peak 1.5 GiB" in widget_text(
            app, "#detail-progress"
        )
        await pilot.press("a")  # the run's kind screen shows the same
        await wait_for(pilot, lambda: nvml in widget_text(app, "#run-progress"))
        proc.kill()
        proc.wait()
        await wait_for(pilot, lambda: "crashed" in widget_text(app, "#run-progress"))
        assert "NVML" not in widget_text(app, "#run-progress")  # a process that ended has no NVML figure


async def test_gpus_are_polled_for_a_run_only_while_an_active_run_is_shown(runs_root: Path) -> None:
    run_dir = make_run(runs_root, ("started", {"pid": 1, "attempt": 1}), ("finished", {"summary": {}}))
    source = RunGpuSource(1, GIB)
    app = make_app(screen="runs", telemetry=GpuTelemetry(source))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: "finished" in widget_text(app, "#detail-progress"))
        assert not app.screen.query(RunGpuPoller)  # mounted when an active run is first shown
        assert source.polls == 0 and run_dir.name in widget_text(app, "#detail-progress")
    replayed = make_app(screen="runs", telemetry=GpuTelemetry(ReplaySource(TRACE, speed=None)))
    async with replayed.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert not replayed.screen.query(RunGpuPoller)  # a trace's processes are not this machine's


def test_elapsed_leaves_out_the_time_before_a_resumed_attempt(runs_root: Path) -> None:
    run_dir = make_run(runs_root)
    info = RunInfo(run_dir.name, run_dir, "attribution", "x", created=1000.0, status="running", started=5000.0)
    assert elapsed_seconds(info, now=5030.0) == 30.0
    info.status, info.ended = "finished", 5100.0
    assert elapsed_seconds(info, now=9999.0) == 100.0
    info.started = None  # before its `started` event: counted from creation
    assert elapsed_seconds(info, now=9999.0) == 4100.0


def test_a_check_run_reports_its_stage_and_rate() -> None:
    progress = {"stage": "check: one step at a time (fp32)", "done": 12, "total": 64, "unit": "steps", "rate": 3.5}
    info = RunInfo("r", Path("r"), "attribution", "check", 0.0, "running", progress=progress)
    assert activity_text(info) == "check: one step at a time (fp32) 12/64 (19%) · 3.50 steps/s"
    info.status = "finished"  # once it ended: its count
    assert activity_text(info) == "12/64 (19%)"


async def test_the_stage_a_run_is_in_is_shown(live_run: tuple[Path, subprocess.Popen[bytes]]) -> None:
    run_dir, _ = live_run
    writer = EventWriter(run_dir / "events.jsonl")
    writer.progress(force=True, stage="building the demo model (first use)")
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: "building the demo model" in widget_text(app, "#detail-progress"))
        text = widget_text(app, "#detail-progress")
        assert "stage building the demo model (first use) · elapsed" in text
        assert "░" not in text and "rate" not in text  # a stage without a count has no bar and no rate
        assert table_cell(app, run_dir.name, "progress") == "building the demo model (first use)"
        writer.progress(force=True, done=3, total=8, unit="samples", rate=1.5, eta=4.0, stage="attribution")
        await wait_for(pilot, lambda: "3/8 samples" in widget_text(app, "#detail-progress"))
        assert "rate 1.50 samples/s · ETA 4s" in widget_text(app, "#detail-progress")
        assert "stage attribution" in widget_text(app, "#detail-progress")
        assert table_cell(app, run_dir.name, "progress") == "3/8 (38%)"
    writer.close()
