"""Warm runners (core/runs/warm.py, jobs/warm.py), as real processes: a run handed to one finishes with its start-up
profile saying so and a new runner waiting after it; a cancel reaches it; a launch from another environment starts
a process of its own; a runner ends with the process that keeps it; only a runner working in a run's directory is
verified as that run's process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuopt_tui.core.profiles.io import profile_from_data
from gpuopt_tui.core.runs.events import read_events
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.lifecycle import cancel_run, create_run, handed_to_warm_runner, start_run, wait_stopped
from gpuopt_tui.core.runs.processes import JOB_MODULE, WARM_FLAG, Claim, pid_alive, proc_start_time, unverified
from gpuopt_tui.core.runs.startup import WARM_LAUNCH_STAGE, startup_stages
from gpuopt_tui.core.runs.warm import ready_runners, start_warm_runner, stop_warm_runners, warm_dir

READY_S = 180.0  # a runner's imports on a busy 2-core machine


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("GPUOPT_TUI_HOME", str(tmp_path / "home"))
    yield tmp_path / "home"
    stop_warm_runners(owner=os.getpid())


def ready(pid: int | None = None, *, other_than: int | None = None) -> int:
    """Wait for the runner `pid` (or any but `other_than`) to be ready; its pid."""
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        for runner in ready_runners():
            if runner.pid == pid or (pid is None and runner.pid != other_than):
                return runner.pid
        time.sleep(0.05)
    raise AssertionError(f"no warm runner ready after {READY_S} s")


def demo_run() -> object:
    return profile_from_data({"kind": "attribution", "run": {"device": "cpu"}}, "p.toml")


def test_a_run_handed_to_a_warm_runner_finishes_and_a_new_runner_waits(tmp_path: Path) -> None:
    runner = ready(start_warm_runner(owner=os.getpid(), minutes=5, replace=True))
    run_dir = start_run(demo_run(), root=tmp_path / "runs")
    assert handed_to_warm_runner(run_dir)
    info = wait_stopped(run_dir, 300)
    assert (info.status, info.pid) == ("finished", runner), info.message
    events, _ = read_events(RunDir(run_dir).events)
    stages = startup_stages(events)
    assert stages[0].name == WARM_LAUNCH_STAGE and stages[-1].first_batch
    assert "[info] run" in RunDir(run_dir).log.read_text()  # its output went to the run's log
    replacement = ready(other_than=runner)
    assert stop_warm_runners(owner=os.getpid()) == [replacement]


def test_a_cancel_reaches_a_run_that_a_warm_runner_took(tmp_path: Path) -> None:
    ready(start_warm_runner(owner=os.getpid(), minutes=5, replace=False))
    run_dir = start_run(demo_run(), root=tmp_path / "runs")
    assert handed_to_warm_runner(run_dir)
    cancel_run(run_dir)
    info = wait_stopped(run_dir, 120)
    assert info.status == "cancelled", info.message
    assert ready_runners() == []  # it took no replacement


def test_a_launch_from_another_environment_starts_its_own_process(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="3")  # read when torch is imported: a runner's imports would not fit
    runner = ready(start_warm_runner(owner=os.getpid(), minutes=5, replace=False, env=env))
    run_dir = start_run(demo_run(), root=tmp_path / "runs")
    assert not handed_to_warm_runner(run_dir)
    assert wait_stopped(run_dir, 300).pid != runner
    assert [r.pid for r in ready_runners()] == [runner]


def test_a_runner_ends_with_the_process_that_keeps_it() -> None:
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        runner = ready(start_warm_runner(owner=owner.pid, minutes=5, replace=False))
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 30
    while pid_alive(runner) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(runner)
    assert not (warm_dir() / str(runner)).exists()


def test_only_a_runner_working_in_the_runs_directory_is_verified_as_its_process(tmp_path: Path) -> None:
    run_dir, other = (create_run(demo_run(), root=tmp_path / "runs") for _ in range(2))
    command = [sys.executable, "-m", JOB_MODULE, WARM_FLAG, "--minutes", "1", "--delay", "60"]
    waiting = subprocess.Popen(command, cwd=run_dir, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while WARM_FLAG.encode() not in Path(f"/proc/{waiting.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        claim = Claim(waiting.pid, proc_start_time(waiting.pid), leader=True)
        assert unverified(claim, run_dir) == ""
        assert "is not one of this run's" in unverified(claim, other)
    finally:
        waiting.kill()
        waiting.wait()


def test_the_warm_command_starts_lists_and_stops_a_runner(capsys: pytest.CaptureFixture[str]) -> None:
    from gpuopt_tui.cli import main

    assert main(["warm", "--minutes", "5"]) == 0
    (runner,) = ready_runners()
    assert f"warm runner {runner.pid} ready after" in capsys.readouterr().err  # messages: standard error
    assert main(["warm", "--list"]) == 0
    assert f"{runner.pid}  ready  ends after 5 min without a run" in capsys.readouterr().out  # the list: output
    assert main(["warm", "--stop"]) == 0
    assert f"stopped 1 warm runner(s): {runner.pid}" in capsys.readouterr().err
    main(["warm", "--list"])
    assert "no warm runner is waiting" in capsys.readouterr().out


def test_a_runner_given_a_model_hands_its_weights_to_a_run_on_that_model(tmp_path: Path) -> None:
    """`gpuopt-tui warm --model DIR`: the run on DIR gets the weights read ahead (its log says so); the runner is
    listed with the model, and the launch prefers it over one that read nothing."""
    from lm_cases import save_tiny_decoder

    model = save_tiny_decoder("llama", tmp_path / "model").resolve()
    rows = tmp_path / "data.jsonl"
    rows.write_text('{"prompt": "the cat sat", "completion": "on the mat"}\n{"prompt": "a dog", "completion": "ran"}\n')
    plain = ready(start_warm_runner(owner=os.getpid(), minutes=5, replace=False))
    reader = ready(start_warm_runner(owner=os.getpid(), minutes=5, replace=False, models=(str(model),)))
    assert [r.models for r in ready_runners() if r.pid == reader] == [(str(model),)]
    profile = profile_from_data(
        {"kind": "attribution", "run": {"device": "cpu"}, "model": {"adapter": "hf", "path": str(model)},
         "data": {"source": "jsonl", "path": str(rows), "text_field": "prompt", "max_length": 16},
         "attribution": {"n_steps": 4, "batch_size": 2, "audit_samples": 0}},
        "p.toml",
    )  # fmt: skip
    run_dir = start_run(profile, root=tmp_path / "runs")
    info = wait_stopped(run_dir, 300)
    assert (info.status, info.pid) == ("finished", reader), info.message
    assert "the weights the warm runner read before the run" in RunDir(run_dir).log.read_text()
    assert [r.pid for r in ready_runners()] == [plain]
