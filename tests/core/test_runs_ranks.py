"""Each rank of a run over several processes, as the RunWatcher folds its rank-stamped events."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuopt_tui.core.profiles.io import profile_from_data
from gpuopt_tui.core.runs.events import EventWriter
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.lifecycle import create_run
from gpuopt_tui.core.runs.status import RunWatcher


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    profile = profile_from_data({"kind": "attribution"}, "demo.toml")
    run_dir = create_run(profile, source=tmp_path / "demo.toml", root=tmp_path / "runs")
    RunDir(run_dir).pid.write_text(json.dumps({"pid": 999_999_999, "start_time": None, "attempt": 1}))
    return run_dir


def rank_writer(run_dir: Path, rank: int, device: str) -> EventWriter:
    events = EventWriter(RunDir(run_dir).events, rank=rank)
    events.emit("rank_started", host="node-a", pid=1000 + rank, start_time=None, device=device)
    return events


def progress(events: EventWriter, done: int, total: int, **extra: Any) -> None:
    events.progress(force=True, done=done, total=total, unit="samples", stage="attribution", **extra)


def test_each_rank_keeps_its_own_progress_and_state(run_dir: Path) -> None:
    runner = EventWriter(RunDir(run_dir).events)
    runner.emit("started", pid=999_999_999, attempt=1, scale="3 process(es)", nodes=1)
    watcher = RunWatcher(run_dir.parent)
    ranks = [rank_writer(run_dir, rank, f"cuda:{rank}") for rank in range(3)]
    info = watcher.info(run_dir)
    assert [(w.rank, w.device) for w in info.workers] == [(0, "cuda:0"), (1, "cuda:1"), (2, "cuda:2")]
    assert {r: p["state"] for r, p in info.rank_progress.items()} == {0: "running", 1: "running", 2: "running"}
    assert "done" not in info.rank_progress[0]  # no progress reported yet

    progress(ranks[0], 4, 10, rate=2.0, gpu_reserved=6)
    progress(ranks[1], 7, 10, rate=3.5, gpu_reserved=5)
    progress(ranks[2], 1, 10, rate=0.5, gpu_reserved=4)
    ranks[1].emit("rank_finished", host="node-a")
    ranks[2].emit("rank_failed", host="node-a", message="CUDA out of memory")
    info = watcher.info(run_dir)
    by_rank = info.rank_progress
    assert [(p["done"], p["total"], p["rate"], p["gpu_reserved"]) for p in by_rank.values()] == [
        (4, 10, 2.0, 6),
        (7, 10, 3.5, 5),
        (1, 10, 0.5, 4),
    ]
    assert [(p["state"], p["message"]) for p in by_rank.values()] == [
        ("running", ""),
        ("finished", ""),
        ("failed", "CUDA out of memory"),
    ]
    assert (info.progress["done"], info.progress["total"], info.progress["ranks"]) == (12, 30, 3)

    before = info
    progress(ranks[0], 10, 10, rate=2.5)
    after = watcher.info(run_dir)
    assert after.rank_progress[0]["done"] == 10 and before.rank_progress[0]["done"] == 4  # no shared state
    assert before != after


def test_a_rank_that_fails_before_it_starts_is_listed(run_dir: Path) -> None:
    EventWriter(RunDir(run_dir).events).emit("started", pid=999_999_999, attempt=1)
    EventWriter(RunDir(run_dir).events, rank=1).emit("rank_failed", host="node-b", message="no profile.toml")
    info = RunWatcher(run_dir.parent).info(run_dir)
    assert info.workers == ()
    assert info.rank_progress == {1: {"state": "failed", "message": "no profile.toml"}}


def test_a_new_attempt_forgets_the_ranks_of_the_last(run_dir: Path) -> None:
    runner = EventWriter(RunDir(run_dir).events)
    runner.emit("started", pid=999_999_999, attempt=1)
    rank = rank_writer(run_dir, 0, "cpu")
    progress(rank, 3, 8)
    rank.emit("rank_cancelled", host="node-a", message="cancelled on request")
    runner.emit("cancelled", message="cancelled on request")
    watcher = RunWatcher(run_dir.parent)
    assert watcher.info(run_dir).rank_progress[0]["state"] == "cancelled"
    runner.emit("started", pid=999_999_999, attempt=2)
    info = watcher.info(run_dir)
    assert info.rank_progress == {} and info.workers == ()


def test_an_ordinary_run_has_no_ranks(run_dir: Path) -> None:
    runner = EventWriter(RunDir(run_dir).events)
    runner.emit("started", pid=999_999_999, attempt=1)
    progress(runner, 2, 5)
    info = RunWatcher(run_dir.parent).info(run_dir)
    assert info.progress["done"] == 2 and info.rank_progress == {} and info.workers == ()


def test_show_lists_each_rank(run_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from gpuopt_tui.cli import main

    EventWriter(RunDir(run_dir).events).emit("started", pid=999_999_999, attempt=1, scale="2 process(es)", nodes=1)
    ranks = [rank_writer(run_dir, rank, f"cuda:{rank}") for rank in range(2)]
    progress(ranks[0], 3, 5)
    ranks[1].emit("rank_failed", host="node-a", message="[disk] full")
    RunDir(run_dir).log.write_text("[info] rank 0/2 on node-a, cuda:0\n")
    monkeypatch.setenv("GPUOPT_TUI_RUNS_DIR", str(run_dir.parent))
    assert main(["show", run_dir.name, "--lines", "0"]) == 0
    out = capsys.readouterr().out
    assert "ranks (2):" in out and "0: running    node-a cuda:0 pid 1000  3/5 samples" in out
    assert "1: failed     node-a cuda:1 pid 1001  -  [disk] full" in out and "log.txt" not in out
