"""Fixtures for driving the app: an isolated data directory, real run directories, and screen text."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from textual.app import App

from gpuopt_tui.core.atomic import atomic_write_text
from gpuopt_tui.core.events import EventWriter
from gpuopt_tui.core.profiles.io import find_profile, load_profile
from gpuopt_tui.core.runs import create_run


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
    """A real run directory (made by core.runs.create_run from the shipped demo profile) with the given events,
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


@pytest.fixture
def live_run(runs_root: Path) -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """A run directory whose recorded process is alive: a sleeping process in its own session, started with the
    run directory as its argument as the job is (so that it passes as the run's), stands in for the job, so
    signals sent by the app can be observed without an engine."""
    run_dir = make_run(runs_root)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(run_dir)], start_new_session=True)
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


def notifications(app: App[object]) -> list[str]:
    return [n.message for n in app._notifications]


async def wait_for(pilot: object, condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Let the app run until `condition()` holds (polls land in between); fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await pilot.pause(0.1)  # type: ignore[attr-defined]
        await asyncio.sleep(0)


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
