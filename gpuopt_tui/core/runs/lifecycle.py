"""Runs: child processes that outlive the terminal, each with its own directory (laid out by core.runs.layout).

Here runs are found, created, started, cancelled, resumed and deleted; core.runs.status reads what they are doing.
Finding and reading runs needs no profile code (the TUI does it before its first frame): the profile modules are
imported where a run is created or resumed.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from gpuopt_tui.core.atomic import atomic_write_text
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.paths import runs_dir
from gpuopt_tui.core.runs.events import EventWriter
from gpuopt_tui.core.runs.files import (
    check_free_space,
    check_run_id,
    is_int,
    read_object,
    remove_stale_partial_writes,
    run_lock,
)
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.processes import (
    JOB_MODULE,
    NEUTRAL_CWD,
    Claim,
    adopt,
    proc_start_time,
    run_env,
    send,
    stop_signal_held,
    unverified,
    verified,
)
from gpuopt_tui.core.runs.startup import LAUNCHED_AT_ENV
from gpuopt_tui.core.runs.status import RESUMABLE, RunInfo, RunWatcher, this_host
from gpuopt_tui.core.runs.warm import take_warm_runner

if TYPE_CHECKING:
    from gpuopt_tui.core.profiles.common import ProfileBase


def unreadable_runs_dir(root: Path, error: OSError) -> UserError:
    return UserError(f"cannot read the runs directory {root} ({error.strerror or error})")


def find_run(run_id: str, root: Path | None = None) -> Path:
    """A run directory by id or unique id prefix."""
    check_run_id(run_id)
    root = root or runs_dir()
    try:
        dirs = RunWatcher(root).run_dirs()
    except OSError as e:
        raise unreadable_runs_dir(root, e) from None
    matches = [p for p in dirs if p.name == run_id] or [p for p in dirs if p.name.startswith(run_id)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise UserError(f"run id {run_id!r} is ambiguous: {', '.join(p.name for p in matches[:5])}")
    raise UserError(f"no run {run_id!r} in {root} (see `gpuopt-tui runs`)")


# --- creating, launching, cancelling, resuming ----------------------------------------------------------------


def create_run(profile: ProfileBase, source: Path | None = None, root: Path | None = None) -> Path:
    """Make a run directory with the frozen profile; returns it. Does not start the process."""
    from gpuopt_tui.core.kinds import engine_available
    from gpuopt_tui.core.profile_paths import resolve_paths
    from gpuopt_tui.core.profiles.io import profile_to_toml

    if not engine_available(profile.kind):
        raise UserError(f"the '{profile.kind}' run kind has no engine in this version of gpuopt-tui")
    resolve_paths(profile, source.parent.resolve() if source else Path.cwd(), str(source or ""))
    root = root or runs_dir()
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{profile.kind}-{secrets.token_hex(2)}"
    run_dir = root / run_id
    try:
        run_dir.mkdir(parents=True)
        for sub in RunDir.FOLDERS:
            (run_dir / sub).mkdir()
    except OSError as e:
        raise UserError(
            f"cannot create the run directory {run_dir} ({e.strerror or e}); "
            "choose another with --runs-dir or GPUOPT_TUI_RUNS_DIR"
        ) from None
    meta = {
        "id": run_id,
        "kind": profile.kind,
        "name": profile.name or profile.kind,
        "created": time.time(),
        "source": str(source) if source else "",
    }
    try:
        atomic_write_text(RunDir(run_dir).profile, profile_to_toml(profile))
        atomic_write_text(RunDir(run_dir).meta, json.dumps(meta, indent=2))  # last: a run is listed once it is whole
    except UserError:
        shutil.rmtree(run_dir, ignore_errors=True)  # no directory that no listing shows is left behind
        raise
    return run_dir


def launch(run_dir: Path, launched_at: float | None = None) -> int:
    """Start (or restart) the run's process in its own session; returns its pid. `launched_at` (unix time, default
    now) is where the run's start-up profile begins (core/runs/startup.py): the command's start, for
    `gpuopt-tui run`."""
    files = RunDir(run_dir)
    record, _ = read_object(files.pid)
    previous = (record or {}).get("attempt", 0)
    attempt = (previous if is_int(previous) and previous >= 0 else 0) + 1
    check_free_space(run_dir)
    remove_stale_partial_writes(run_dir)
    env = run_env()
    env[LAUNCHED_AT_ENV] = repr(time.time() if launched_at is None else launched_at)
    taken = take_warm_runner(run_dir, env)
    pid, start_time = taken or _start_process(run_dir, env)
    record = {"pid": pid, "start_time": start_time, "attempt": attempt, "host": this_host(), "warm": bool(taken)}
    try:
        atomic_write_text(files.pid, json.dumps(record))
    except UserError:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)  # a run nobody could find again must not go on
        raise
    return pid


def handed_to_warm_runner(run_dir: Path) -> bool:
    """Whether the run's last launch handed it to a warm runner (core/runs/warm.py)."""
    record, _ = read_object(RunDir(run_dir).pid)
    return bool(record and record.get("warm") is True)


def _start_process(run_dir: Path, env: dict[str, str]) -> tuple[int, int | None]:
    """Start the run's process in its own session: (its pid, its start time)."""
    try:
        with RunDir(run_dir).log.open("ab") as log, stop_signal_held():
            proc = subprocess.Popen(
                [sys.executable, "-m", JOB_MODULE, str(run_dir.resolve())],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own session: SIGHUP / Ctrl-C of the terminal do not reach it
                cwd=NEUTRAL_CWD,  # never the run directory: nothing in it may be imported
                env=env,
            )
    except OSError as e:
        raise UserError(f"cannot start the run in {run_dir} ({e.strerror or e})") from None
    adopt(proc)
    return proc.pid, proc_start_time(proc.pid)


def start_run(
    profile: ProfileBase, source: Path | None = None, root: Path | None = None, launched_at: float | None = None
) -> Path:
    """Create a run and start it (`launched_at`: see `launch`). A run that could not start (a full disk) is recorded
    as failed, so that it can be resumed at once; one whose failure cannot even be recorded is removed."""
    run_dir = create_run(profile, source, root)
    try:
        launch(run_dir, launched_at)
    except UserError as e:
        if not _record_end(run_dir, "failed", f"could not start: {e}"):
            shutil.rmtree(run_dir, ignore_errors=True)
            raise UserError(f"{e} (the run was not kept: start it again)") from None
        raise
    return run_dir


def _worker_claims(info: RunInfo) -> list[Claim]:
    return [Claim(w.pid, w.start_time) for w in info.local_workers()]


def _record_end(run_dir: Path, end: str, message: str) -> bool:
    """Write the end event (`cancelled`, `failed`) that the run's own process can no longer write (killed, dead,
    or never started); False if it could not be written."""
    try:
        events = EventWriter(RunDir(run_dir).events)
        try:
            events.emit(end, message=message)
        finally:
            events.close()
    except OSError:
        return False
    return True


def cancel_run(run_dir: Path, force: bool = False) -> RunInfo:
    """Ask a running run to stop (SIGTERM to its process group and its workers here); `force` kills it (SIGKILL).
    A crashed run's workers that outlived its process are stopped the same way. Only processes verified to be the
    run's are signalled (see core.runs.processes)."""
    info = RunWatcher(run_dir.parent).info(run_dir)
    sig = signal.SIGKILL if force else signal.SIGTERM
    if not info.active:
        stopped = send(_worker_claims(info), run_dir, sig)
        if not stopped:
            raise UserError(f"run {info.id} is not running (it is {info.status})")
        if info.status == "crashed":
            message = f"the run's process had ended; {len(stopped)} worker process(es) left were stopped"
            _record_end(run_dir, "cancelled", message)
        return info
    if info.remote:
        raise UserError(f"run {info.id} runs on {info.host}; cancel it there: gpuopt-tui cancel {info.id}")
    if not info.pid:
        raise UserError(f"run {info.id} has no process yet (it is {info.status}); try again in a moment")
    leader = Claim(info.pid, info.pid_start_time, leader=True)
    reason = unverified(leader, run_dir)
    if reason:
        raise UserError(f"run {info.id} was not signalled: its {RunDir.PID} names pid {info.pid}, but {reason}")
    send([leader, *_worker_claims(info)], run_dir, sig)
    if force:
        _record_end(run_dir, "cancelled", "killed (SIGKILL); shards finished before were kept")
    return info


def active_run_pids(infos: Iterable[RunInfo]) -> dict[int, str]:
    """pid -> run id for the processes of every active run (for matching GPU processes to runs)."""
    return {pid: info.id for info in infos if info.active for pid in info.pids()}


def resume_run(run_dir: Path) -> int:
    """Restart a cancelled, failed or crashed run; its engine skips the shards already finished. The check and
    the launch happen under the run's lock: of two resumes at once, one launches and the other is refused."""
    with run_lock(run_dir, "resumed"):
        info = RunWatcher(run_dir.parent).info(run_dir)
        if info.status not in RESUMABLE:
            raise UserError(f"run {info.id} is {info.status}; only cancelled, failed or crashed runs can be resumed")
        alive = [c.pid for c in verified(_worker_claims(info), run_dir)]
        if alive:
            raise UserError(
                f"run {info.id} still has {len(alive)} worker process(es) of its last attempt running "
                f"(pid {', '.join(map(str, alive))}); stop them first: gpuopt-tui cancel {info.id}"
            )
        from gpuopt_tui.core.profiles.io import load_profile

        load_profile(RunDir(run_dir).profile)  # fail early and clearly if the frozen profile is unreadable
        return launch(run_dir)


def delete_run(run_dir: Path) -> None:
    info = RunWatcher(run_dir.parent).info(run_dir)
    if info.active:
        raise UserError(f"run {info.id} is still running; cancel it first")
    shutil.rmtree(run_dir, ignore_errors=True)


def _poll_until(run_dir: Path, done: Callable[[RunInfo], bool], timeout: float) -> RunInfo:
    watcher = RunWatcher(run_dir.parent)
    deadline = time.monotonic() + timeout
    while True:
        info = watcher.info(run_dir)
        if done(info) or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


def wait_for(run_dir: Path, statuses: frozenset[str], timeout: float) -> RunInfo:
    """Poll until the run reaches one of `statuses` or `timeout` seconds pass; returns the last info."""
    return _poll_until(run_dir, lambda info: info.status in statuses, timeout)


def still_running(info: RunInfo) -> bool:
    """Whether the run, or any of its workers here (a crashed run's may outlive it), is still running."""
    return info.active or bool(verified(_worker_claims(info), info.dir))


def wait_stopped(run_dir: Path, timeout: float) -> RunInfo:
    """Poll until the run is over and none of its workers here is alive, or `timeout` seconds pass."""
    return _poll_until(run_dir, lambda info: not still_running(info), timeout)
