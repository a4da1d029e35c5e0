"""The start-up profile (core/runs/startup.py): a chain of stages from the launch to the first computed batch, each
reported once as it ends; the reader takes the last attempt's."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from gpuopt_tui.core.runs.events import EventWriter, read_events
from gpuopt_tui.core.runs.startup import (
    FIRST_BATCH,
    LAUNCH_STAGE,
    LAUNCHED_AT_ENV,
    PYTHON_STAGE,
    StartupClock,
    launched_at_from_env,
    startup_headline,
    startup_lines,
    startup_stages,
    this_process_started,
)
from gpuopt_tui.jobs.context import JobContext


def emitted() -> tuple[list[dict[str, Any]], Any]:
    events: list[dict[str, Any]] = []
    return events, lambda type, **fields: events.append({"type": type, **fields})


def test_stages_are_reported_in_order_as_a_chain_up_to_the_first_batch() -> None:
    events, emit = emitted()
    clock = StartupClock(emit, launched_at=this_process_started() - 1.0)
    for name in ("importing torch", "loading the model", "loading the model", "attribution"):
        clock.begin(name)
    clock.first_batch()
    clock.begin("writing results")  # after the first batch: start-up is over
    clock.first_batch()
    names = [e["stage"] for e in events]
    assert names == [
        LAUNCH_STAGE,
        PYTHON_STAGE,
        "importing torch",
        "loading the model",  # said twice in a row: one stage
        f"attribution ({FIRST_BATCH})",
    ]
    assert {e["type"] for e in events} == {"startup"}
    assert all(e["seconds"] >= 0 for e in events)
    ends = [e["at"] for e in events]
    assert ends == sorted(ends)
    for before, event in itertools.pairwise(events):
        assert event["at"] - event["seconds"] == pytest.approx(before["at"], abs=1e-3)
    assert [e.get("first_batch", False) for e in events] == [False] * 4 + [True]


def test_without_a_launch_time_the_profile_starts_with_the_process() -> None:
    events, emit = emitted()
    clock = StartupClock(emit, launched_at=None)
    clock.begin("importing torch")
    assert [e["stage"] for e in events] == [PYTHON_STAGE]


def test_a_launch_time_from_long_before_the_process_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """An inherited variable (a run started from within another run's process) must not count hours of start-up."""
    events, emit = emitted()
    clock = StartupClock(emit, launched_at=this_process_started() - 86400)
    clock.begin("importing torch")
    assert [e["stage"] for e in events] == [PYTHON_STAGE]
    monkeypatch.setenv(LAUNCHED_AT_ENV, "not a number")
    assert launched_at_from_env() is None
    monkeypatch.setenv(LAUNCHED_AT_ENV, "1795900000.25")
    assert launched_at_from_env() == 1795900000.25


def test_the_job_context_times_its_stages_and_ends_with_the_first_batch(tmp_path: Path) -> None:
    events = EventWriter(tmp_path / "events.jsonl")
    events.emit("started", pid=1, attempt=1)
    ctx = JobContext(tmp_path, events, tmp_path / "cache", startup=StartupClock(events.emit, None))
    ctx.stage("loading the model")
    ctx.stage("preparing the engine")
    ctx.progress(0, 8, stage="attribution")
    ctx.progress(4, 8, stage="attribution")
    ctx.first_batch_done()
    ctx.progress(8, 8, stage="attribution")
    ctx.stage("writing results")
    events.close()
    written, corrupt = read_events(tmp_path / "events.jsonl")
    assert not corrupt
    profile = startup_stages(written)
    assert [s.name for s in profile] == [
        PYTHON_STAGE,
        "loading the model",
        "preparing the engine",
        f"attribution ({FIRST_BATCH})",
    ]
    assert profile[-1].first_batch and startup_headline(profile).endswith(FIRST_BATCH)
    assert len(startup_lines(profile)) == len(profile)


def test_the_reader_keeps_the_last_attempt_and_says_when_start_up_has_not_ended() -> None:
    first = [{"type": "started"}, {"type": "startup", "stage": "importing torch", "seconds": 1.0, "at": 1.5}]
    second = [
        {"type": "started"},
        {"type": "startup", "stage": PYTHON_STAGE, "seconds": 0.25, "at": 0.25},
        {"type": "startup", "stage": "importing torch", "seconds": 2.0},  # damaged: no `at`
        {"type": "progress", "stage": "importing torch"},
    ]
    profile = startup_stages(first + second)
    assert [s.name for s in profile] == [PYTHON_STAGE]
    assert startup_headline(profile) == f"0.25 s from the launch so far (to the end of: {PYTHON_STAGE})"
    assert startup_headline([]) == ""
