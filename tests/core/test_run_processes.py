"""Which processes a run may signal, resume, and start: only its own, once, and never with code from its directory."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.io import profile_from_data
from gpuopt_tui.core.runs.events import EventTail, EventWriter
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.lifecycle import cancel_run, create_run, resume_run, start_run, wait_stopped
from gpuopt_tui.core.runs.processes import JOB_MODULE, WORKER_MODULE, pid_alive, proc_start_time
from gpuopt_tui.core.runs.status import RunWatcher, this_host

DEAD_START = 1  # a start time no live process has (clock ticks since boot)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return create_run(profile_from_data({"kind": "attribution"}, "p.toml"), root=tmp_path / "runs")


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def sleeper(
    procs: list[subprocess.Popen[bytes]], run_dir: Path | None = None, module: str | None = JOB_MODULE
) -> subprocess.Popen[bytes]:
    """A process in its own session; started with a run directory after `-m` and the job `module` it is that
    run's process, as the run's own process and torchrun's workers are. `module` None: it only names the
    directory, as `du RUN_DIR` does."""
    args = [] if run_dir is None else [str(run_dir)] if module is None else ["-m", module, str(run_dir)]
    cmd = [sys.executable, "-c", "import time; time.sleep(60)", *args]
    proc = subprocess.Popen(cmd, start_new_session=True)
    procs.append(proc)
    deadline = time.monotonic() + 30
    while b"time.sleep(60)" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline  # until the fork has become python with these arguments
        time.sleep(0.01)
    return proc


def dead_pid(procs: list[subprocess.Popen[bytes]]) -> int:
    proc = sleeper(procs)
    proc.kill()
    proc.wait()
    return proc.pid


def write_pid(run_dir: Path, pid: int, start_time: int | None) -> None:
    RunDir(run_dir).pid.write_text(json.dumps({"pid": pid, "start_time": start_time, "attempt": 1}))


def workers(run_dir: Path, *claims: tuple[int, int | None]) -> None:
    """A `started` event, then a `rank_started` event on this host for each (pid, start_time)."""
    events = EventWriter(RunDir(run_dir).events)
    events.emit("started", attempt=1)
    for rank, (pid, start) in enumerate(claims):
        events.emit("rank_started", rank=rank, host=this_host(), pid=pid, start_time=start, device="cpu")
    events.close()


class Signals:
    """Records os.kill and os.killpg instead of sending anything."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: list[tuple[str, int, int]] = []
        monkeypatch.setattr(os, "kill", lambda pid, sig: self.sent.append(("kill", pid, sig)))
        monkeypatch.setattr(os, "killpg", lambda pid, sig: self.sent.append(("killpg", pid, sig)))


def test_cancel_signals_no_process_that_is_not_verified_as_the_runs(
    run_dir: Path, procs: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    leader, worker = sleeper(procs, run_dir), sleeper(procs, run_dir, WORKER_MODULE)
    stranger = sleeper(procs)
    reused = sleeper(procs, run_dir)  # the run's directory in its arguments, but not the recorded start time
    gone = dead_pid(procs)
    own = os.getpid()
    write_pid(run_dir, leader.pid, proc_start_time(leader.pid))
    workers(
        run_dir,
        (-1, None),
        (0, None),
        (1, None),
        (own, proc_start_time(own)),
        (gone, None),
        (stranger.pid, proc_start_time(stranger.pid)),
        (reused.pid, DEAD_START),
        (worker.pid, proc_start_time(worker.pid)),
    )
    signals = Signals(monkeypatch)
    cancel_run(run_dir)
    assert signals.sent == [("killpg", leader.pid, signal.SIGTERM), ("kill", worker.pid, signal.SIGTERM)]


@pytest.mark.parametrize("claim", ["-1", "0", "1", "own", "dead", "stranger", "reused", "du", "other-module"])
def test_a_pid_file_naming_another_process_gets_nothing_signalled(
    claim: str, run_dir: Path, procs: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    if claim in ("-1", "0", "1"):
        pid, start = int(claim), None
    elif claim == "own":
        pid, start = os.getpid(), proc_start_time(os.getpid())
    elif claim == "dead":
        pid, start = dead_pid(procs), None
    elif claim == "stranger":
        pid = sleeper(procs).pid
        start = proc_start_time(pid)
    elif claim == "reused":
        pid, start = sleeper(procs, run_dir).pid, DEAD_START
    else:  # a live process that names the run directory without being the run's (du RUN_DIR, tar cf x RUN_DIR)
        pid = sleeper(procs, run_dir, module=None if claim == "du" else "gpuopt_tui.jobsx").pid
        start = proc_start_time(pid)
    write_pid(run_dir, pid, start)
    workers(run_dir)
    signals = Signals(monkeypatch)
    with pytest.raises(UserError, match="not running|was not signalled"):
        cancel_run(run_dir)
    assert signals.sent == []


def test_pid_alive_is_false_for_pids_that_name_no_single_process() -> None:
    assert not any(pid_alive(pid) for pid in (-1, 0, 1, 2**40, "12", None, True))


def test_a_crashed_runs_surviving_workers_block_resume_and_are_cancelled(
    run_dir: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    write_pid(run_dir, dead_pid(procs), None)  # the run's own process was killed (kill -9)
    worker = sleeper(procs, run_dir)
    workers(run_dir, (worker.pid, proc_start_time(worker.pid)))
    info = RunWatcher(run_dir.parent).info(run_dir)
    assert info.status == "crashed" and info.orphans == (worker.pid,)
    assert "1 of its worker processes are still running" in info.message
    with pytest.raises(UserError, match=rf"still has 1 worker process\(es\).*pid {worker.pid}.*gpuopt-tui cancel"):
        resume_run(run_dir)
    cancel_run(run_dir)
    assert worker.wait(timeout=30) == -signal.SIGTERM
    info = RunWatcher(run_dir.parent).info(run_dir)
    assert info.status == "cancelled" and "worker process(es) left were stopped" in info.message


def test_two_resumes_at_once_launch_once(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_pid(run_dir, 2**22 + 1, None)  # crashed
    launched: list[Path] = []

    def launch(path: Path) -> int:
        with pytest.raises(UserError, match="is being resumed by another process"):
            resume_run(path)  # a second resume while the first is between its check and its launch
        launched.append(path)
        return 0

    monkeypatch.setattr("gpuopt_tui.core.runs.lifecycle.launch", launch)
    resume_run(run_dir)
    assert launched == [run_dir]
    with (run_dir / ".lock").open("a") as held:  # another process holding the lock
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(UserError, match="is being resumed by another process"):
            resume_run(run_dir)


def test_a_run_cancelled_while_its_process_starts_ends_cancelled(tmp_path: Path) -> None:
    """A cancel sent at once after a start or a resume reaches the process before Python has set its handler: the
    process holds the signal until then, and ends cancelled, not crashed."""
    run_dir = start_run(profile_from_data({"kind": "attribution", "run": {"device": "cpu"}}, "p.toml"), root=tmp_path)
    for attempt in (1, 2):
        if attempt == 2:
            resume_run(run_dir)
        cancel_run(run_dir)
        info = wait_stopped(run_dir, 120)
        assert (info.status, info.attempt) == ("cancelled", attempt), info.message


@pytest.mark.parametrize("safe_path", [True, False], ids=["PYTHONSAFEPATH", "working-directory-only"])
def test_a_resumed_run_imports_nothing_from_its_directory(
    safe_path: bool, run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not safe_path:  # as on Python 3.10, which ignores PYTHONSAFEPATH: the working directory alone must do
        monkeypatch.setattr("gpuopt_tui.core.runs.lifecycle.run_env", lambda: {**os.environ, "PYTHONUNBUFFERED": "1"})
    planted = tmp_path / "planted"
    for name in ("platformdirs", "json", "tomllib", "gpuopt_tui"):  # imported by the run's process at start
        (run_dir / f"{name}.py").write_text(f"open({str(planted)!r}, 'a').write('{name} ')\n")
    plugins = tmp_path / "plugins"  # PYTHONPATH still reaches the run's process (users' plugin models)
    plugins.mkdir()
    (plugins / "sitecustomize.py").write_text(f"open({str(tmp_path / 'plugin-imported')!r}, 'w').close()\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(plugins), os.environ.get("PYTHONPATH", "")]))
    write_pid(run_dir, 2**22 + 1, None)  # crashed: resumable
    pid = resume_run(run_dir)
    try:
        tail, deadline = EventTail(RunDir(run_dir).events), time.monotonic() + 120
        while not any(e["type"] in ("started", "failed") for e in tail.read()):
            assert pid_alive(pid) and time.monotonic() < deadline, RunDir(run_dir).log.read_text()
            time.sleep(0.05)
    finally:
        os.killpg(pid, signal.SIGKILL)
    assert not planted.exists(), f"imported from the run directory: {planted.read_text()}"
    assert (tmp_path / "plugin-imported").exists()
