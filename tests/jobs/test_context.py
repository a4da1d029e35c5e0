"""JobContext: shards, the resume record, cancellation and progress rate."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.events import EventWriter, read_events
from gpuopt_tui.jobs.context import JobCancelled, JobContext


@pytest.fixture
def ctx(tmp_path: Path) -> JobContext:
    return JobContext(tmp_path / "run", EventWriter(tmp_path / "events.jsonl"), tmp_path / "cache")


def test_shards_appear_whole_or_not_at_all(ctx: JobContext) -> None:
    def broken_writer(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        ctx.save_shard("batch_0", broken_writer)
    assert not ctx.shard_done("batch_0")
    ctx.save_shard("batch_0", lambda tmp: tmp.write_text("whole"))
    assert ctx.shard_done("batch_0") and ctx.shard_path("batch_0").read_text() == "whole"
    assert "batch_0" in ctx.finished_shards()


def test_resume_record_refuses_other_settings(ctx: JobContext) -> None:
    ctx.check_resume_record({"n_steps": 50, "data": "abc"})
    ctx.check_resume_record({"n_steps": 50, "data": "abc"})  # same settings: resuming is fine
    with pytest.raises(UserError, match="other settings or data"):
        ctx.check_resume_record({"n_steps": 64, "data": "abc"})


def test_cancel_is_raised_only_when_checked(ctx: JobContext) -> None:
    ctx.check_cancelled()
    ctx.request_cancel()
    assert ctx.cancelled
    with pytest.raises(JobCancelled):
        ctx.check_cancelled()


def test_progress_reports_rate_eta_and_final_step(ctx: JobContext, tmp_path: Path, monkeypatch) -> None:
    # one shared clock: each progress call reads it in the context (rate) and in the writer (throttle)
    clock = iter([100.0, 100.0, 101.0, 100.1, 102.0, 100.2])
    monkeypatch.setattr("time.monotonic", lambda: next(clock))
    ctx.progress(0, 40)
    ctx.progress(10, 40)  # throttled (same writer clock), but counted for the rate
    ctx.progress(40, 40)  # the last step is always written
    events, _ = read_events(tmp_path / "events.jsonl")
    progress = [e for e in events if e["type"] == "progress"]
    assert [e["done"] for e in progress] == [0, 40]
    assert progress[-1]["rate"] == pytest.approx(20.0)  # 40 items in 2 s
    assert progress[-1]["eta"] == 0
