"""Fixtures for driving the app: an isolated data directory, real run directories (made here or frozen from the
engines by tests/fixtures/make_runs.py), waiting on the app's own progress, and screen text."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from textual.app import App
from textual.command import Command, CommandList
from textual.css.query import NoMatches
from textual.pilot import Pilot
from textual.widgets import DataTable, Tabs

from gpuopt_tui.app import GpuOptApp
from gpuopt_tui.core.atomic import atomic_write_text
from gpuopt_tui.core.profiles.io import find_profile, load_profile
from gpuopt_tui.core.runs.events import EventWriter
from gpuopt_tui.core.runs.lifecycle import create_run
from gpuopt_tui.core.runs.processes import JOB_MODULE
from gpuopt_tui.ui.gpu_poller import GpuPoller
from gpuopt_tui.ui.screens.results import ResultsScreen
from gpuopt_tui.ui.widgets.runs_table import RunsTable

FROZEN_RUNS = Path(__file__).parents[1] / "fixtures" / "runs"


@pytest.fixture(autouse=True)
def data_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every UI test gets its own data directory, runs directory and user profiles."""
    home = tmp_path / "home"
    monkeypatch.setenv("GPUOPT_TUI_HOME", str(home))
    monkeypatch.setenv("GPUOPT_TUI_RUNS_DIR", str(home / "runs"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("TEXTUAL_ANIMATIONS", raising=False)
    return home


@pytest.fixture
def runs_root(data_home: Path) -> Path:
    return data_home / "runs"


@pytest.fixture
def user_profiles(data_home: Path) -> Path:
    path = data_home / "config" / "profiles"
    path.mkdir(parents=True)
    return path


def make_run(root: Path, *events: tuple[str, dict[str, object]], log: str = "") -> Path:
    """A real run directory (made by core.runs.lifecycle.create_run from the shipped demo profile) with the given events,
    written by the same EventWriter the jobs use. No process is started."""
    path = find_profile("demo-attribution")
    run_dir = create_run(load_profile(path), source=path, root=root)
    writer = EventWriter(run_dir / "events.jsonl")
    for kind, fields in events:
        writer.emit(kind, **fields)
    writer.close()
    atomic_write_text(run_dir / "log.txt", log)
    atomic_write_text(run_dir / "pid.json", '{"pid": 0, "attempt": 1}')
    return run_dir


def frozen_source(kind: str) -> Path:
    """The finished run of `kind`'s engine frozen in tests/fixtures/runs (read-only: copy it with `frozen_run`)."""
    (run_dir,) = (p for p in (FROZEN_RUNS / kind).iterdir() if p.name != "cache")
    return run_dir


def frozen_run(kind: str, runs_root: Path) -> Path:
    """The frozen finished run of `kind`, copied into `runs_root` under its own id."""
    source = frozen_source(kind)
    run_dir = Path(shutil.copytree(source, runs_root / source.name))
    (run_dir / "state").mkdir(exist_ok=True)  # as create_run makes it; the fixture keeps no checkpoints
    return run_dir


@pytest.fixture
def live_run(runs_root: Path) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """A run directory whose recorded process is alive: a sleeping process in its own session, started with the
    job module and the run directory as its arguments as the job is (so that it passes as the run's), stands in for
    the job, so signals sent by the app can be observed without an engine."""
    run_dir = make_run(runs_root)
    args = ["-m", JOB_MODULE, str(run_dir)]
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *args], start_new_session=True)
    EventWriter(run_dir / "events.jsonl").emit("started", pid=proc.pid, attempt=1)
    atomic_write_text(run_dir / "pid.json", f'{{"pid": {proc.pid}, "attempt": 1}}')
    yield run_dir, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def screen_lines(app: App[object]) -> list[str]:
    """The text on the terminal right now, one string per line."""
    return [strip.text for strip in app.screen._compositor.render_strips()]


def screen_text(app: App[object]) -> str:
    return "\n".join(screen_lines(app))


async def open_from_runs(pilot: Pilot[object], app: GpuOptApp, run_id: str) -> ResultsScreen:
    """Open the results of `run_id` as a user does: select it on the Runs screen (the app shows it) and press enter."""
    await wait_for(pilot, lambda: any(r.id == run_id for r in app.runs.runs))
    await pilot.pause()
    table = app.screen.query_one("#runs-table", RunsTable)
    table.select(run_id)
    table.focus()
    await pilot.press("enter")
    await wait_for(pilot, lambda: isinstance(app.screen, ResultsScreen))
    screen = app.screen
    assert isinstance(screen, ResultsScreen) and screen.run_id == run_id
    return screen


async def open_samples(pilot: Pilot[object], run_id: str) -> ResultsScreen:
    """An attribution run's results opened from the Runs screen with enter, its sample list filled."""
    screen = await open_from_runs(pilot, pilot.app, run_id)  # type: ignore[arg-type]
    await wait_for(pilot, lambda: screen.view.query_one("#sample-table", DataTable).row_count > 0)
    await settle(pilot)
    return screen


def attribution_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of a run's attributions.jsonl."""
    lines = (run_dir / "results" / "attributions.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def notifications(app: App[object]) -> list[str]:
    return [n.message for n in app._notifications]


async def wait_for(pilot: Pilot[object], condition: Callable[[], bool], timeout: float = 30.0) -> None:
    """Let the app handle its messages until `condition()` holds (timers, workers and polls land in between); a
    widget it queries that is not mounted yet (results views are mounted when there are results) counts as not yet.
    The timeout only turns a hang into a failure: it is far above what any step takes on a busy machine."""
    deadline = time.monotonic() + timeout
    while not _holds(condition):
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await pilot.pause()


def _holds(condition: Callable[[], bool]) -> bool:
    try:
        return condition()
    except NoMatches:
        return False


async def settle(pilot: Pilot[object]) -> None:
    """Wait until the app has handled its pending messages and the workers they started have finished, and then
    the messages those workers posted, and every tab bar's underline is drawn."""
    await pilot.pause()
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()
    await wait_for(pilot, lambda: underlines_placed(pilot.app))


def underlines_placed(app: App[object]) -> bool:
    """Whether the underline of every tab bar on the screen is under its active tab: Tabs move it once the tab
    is laid out, after a refresh, which a busy machine can leave for later than the last message."""
    return all(
        underline.highlight_end > underline.highlight_start
        for tabs in app.screen.query(Tabs)
        if tabs.active
        for underline in tabs.query("Underline")
    )


class TickCounter:
    """Counts the ticks of a GpuPoller's timer, whether they poll or are skipped: a clock that runs at the app's
    pace, for checking that nothing is polled while it should not be."""

    def __init__(self, poller: GpuPoller) -> None:
        self.count = 0
        tick = poller._tick

        def counted() -> None:
            self.count += 1
            tick()

        poller._tick = counted  # type: ignore[method-assign]  # what the poller arms its next timer with

    async def wait(self, pilot: Pilot[object], ticks: int) -> None:
        seen = self.count
        await wait_for(pilot, lambda: self.count >= seen + ticks)


def palette_highlight(app: App[object]) -> str:
    """The command the command palette highlights now ('' while it shows none)."""
    lists = app.screen.query(CommandList)
    if not lists or lists.first().highlighted is None:
        return ""
    option = lists.first().get_option_at_index(lists.first().highlighted)  # type: ignore[arg-type]
    return option.hit.text or "" if isinstance(option, Command) else ""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]


def flat_text(app: App[object]) -> str:
    """The screen's words with line breaks and padding collapsed, for finding wrapped messages."""
    return " ".join(screen_text(app).split())


def widget_text(app: App[object], selector: str) -> str:
    """The plain text a Static shows (wrapping aside)."""
    return str(app.screen.query_one(selector).content)  # type: ignore[attr-defined]
