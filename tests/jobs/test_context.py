"""JobContext: shards, the resume record, cancellation and progress rate."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.io import load_profile
from gpuopt_tui.core.runs.events import EventWriter, read_events
from gpuopt_tui.jobs import runner
from gpuopt_tui.jobs.context import CHECKSUMS, RESUME_RECORD, JobCancelled, JobContext, ResumePart

PROFILES = Path(__file__).resolve().parents[2] / "profiles"


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


def record(n_steps: int = 50, data: str = "abc") -> dict[str, ResumePart]:
    return {
        "data": ResumePart(data, "the data", "data.path d.jsonl"),
        "settings": ResumePart({"n_steps": n_steps, "method": "riemann"}, "the settings"),
    }


def test_resume_record_refuses_other_settings_or_data_naming_what_changed(ctx: JobContext) -> None:
    ctx.check_resume_record(record())
    ctx.check_resume_record(record())  # same settings and data: resuming is fine
    with pytest.raises(UserError) as refused:
        ctx.check_resume_record(record(n_steps=64))
    assert str(refused.value) == (
        "resume refused: the settings changed since the run started (n_steps: 50 -> 64): start a new run"
    )
    with pytest.raises(UserError) as refused:
        ctx.check_resume_record(record(n_steps=64, data="abd"))
    assert str(refused.value) == (
        "resume refused: the data and the settings changed since the run started "
        "(data.path d.jsonl; n_steps: 50 -> 64): start a new run"
    )


def test_a_resume_record_of_an_older_version_is_refused_as_such(ctx: JobContext) -> None:
    ctx.check_resume_record({"settings": record()["settings"]})  # written before the data was recorded
    with pytest.raises(UserError) as refused:
        ctx.check_resume_record(record())
    assert str(refused.value) == (
        "resume refused: an older gpuopt-tui wrote the resume record (without the data): start a new run"
    )


@pytest.mark.parametrize("saved", [b"", b"{", b"[1]", b"\xff\xfe", b"null"])
def test_a_damaged_resume_record_refuses_with_a_message(ctx: JobContext, saved: bytes) -> None:
    ctx.shard_path(RESUME_RECORD).write_bytes(saved)
    with pytest.raises(UserError, match=r"^resume refused: the resume record .*resume.json .*: start a new run$"):
        ctx.check_resume_record(record())


def test_shards_count_only_whole_and_under_the_same_record(ctx: JobContext, tmp_path: Path) -> None:
    ctx.check_resume_record(record())
    for name in ("a", "b", "c"):
        ctx.save_shard(name, lambda tmp, name=name: tmp.write_text(name * 100))
    assert ctx.finished_shards() == ["a", "b", "c"]  # neither the record nor the checksums count
    ctx.shard_path("a").write_text("b" * 100)  # damaged (same size)
    ctx.shard_path("b").unlink()
    later = JobContext(ctx.run_dir, ctx.events, tmp_path / "cache")  # a resumed attempt
    later.check_resume_record(record())
    assert later.finished_shards() == ["c"]
    other = JobContext(tmp_path / "other", ctx.events, tmp_path / "cache")
    other.check_resume_record(record(data="xyz"))
    other.save_shard("c", lambda tmp: tmp.write_text("c" * 100))  # the same bytes, made from other inputs
    (other.state_dir / CHECKSUMS / "c.json").replace(later.state_dir / CHECKSUMS / "c.json")
    again = JobContext(ctx.run_dir, ctx.events, tmp_path / "cache")
    again.check_resume_record(record())
    assert again.finished_shards() == []
    later.delete_shard("c")
    assert not later.shard_done("c") and not (later.state_dir / CHECKSUMS / "c.json").exists()


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


def test_a_stop_request_while_the_libraries_load_ends_the_run_at_once(
    ctx: JobContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's imports are interrupted (on a loaded machine they take half a minute, with nothing to save)."""
    loaded: list[str] = []

    def engine_import(kind: str) -> object:
        os.kill(os.getpid(), signal.SIGTERM)  # the cancel arrives while the libraries load
        for _ in range(10_000):  # Python code runs on: the handler gets its turn between its steps
            time.sleep(0.001)
        loaded.append(kind)
        return lambda profile, ctx: {}

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    monkeypatch.setattr(runner, "_engine", engine_import)
    try:
        runner.on_stop_signals(ctx.request_cancel)
        outcome, fields = runner.execute(load_profile(PROFILES / "demo-attribution.toml"), ctx)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    assert (outcome, loaded) == ("cancelled", []) and fields["message"] == runner.CANCELLED
