"""The processes of a run: how they are started, whether they live, and signalling only those that are the run's.

A pid read from a run directory (`pid.json`, a worker's `rank_started` event) is only a claim: the file may be
stale (the pid since reused by another process), damaged or planted. A process is signalled only when it is
verified to be the run's: a real pid (above 1: never 0, -1 or init), alive, owned by this user, started at the
recorded time (when one was recorded), and running the run's command line: the job module with the run directory
(the run's process is `python -m gpuopt_tui.jobs RUN_DIR`, or a warm runner's `python -m gpuopt_tui.jobs --warm ...`
working in RUN_DIR; torchrun and its workers `... -m gpuopt_tui.jobs.worker RUN_DIR`), not merely any command that
names the directory. The run's own process must also lead its process
group, which is what it is signalled through (the group holds torchrun).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from gpuopt_tui.core.runs.proc_files import ProcStat, proc_mounted, read_cmdline, read_cwd, read_stat, read_uid

PID_LIMIT = 2**31  # os.kill takes a C int
JOB_MODULE = "gpuopt_tui.jobs"  # `python -m JOB_MODULE RUN_DIR`: a run's own process
WORKER_MODULE = "gpuopt_tui.jobs.worker"  # `torchrun ... -m WORKER_MODULE RUN_DIR`: torchrun and its workers
RUN_MODULES = (JOB_MODULE, WORKER_MODULE)
WARM_FLAG = "--warm"  # `python -m JOB_MODULE --warm ...`: a warm runner (core/runs/warm.py)
# Where the run's processes start. `python -m` puts its working directory first on sys.path (Python 3.10 has no
# -P / PYTHONSAFEPATH), so it must be one that only root can write to: never the run directory.
NEUTRAL_CWD = os.sep
_children: dict[int, subprocess.Popen[bytes]] = {}  # processes this process started, reaped when polled


def job_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a run's processes: unbuffered output, and no working directory on sys.path (Python
    3.11+; PYTHONPATH keeps working)."""
    return dict(os.environ if base is None else base, PYTHONUNBUFFERED="1", PYTHONSAFEPATH="1")


def run_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a run's own process starts with (and a warm runner, which may become one): job_env's, and
    PyTorch's expandable allocator segments unless the user chose otherwise."""
    env = job_env(base)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


@contextlib.contextmanager
def stop_signal_held() -> Iterator[None]:
    """Hold SIGTERM back in this thread while a run's process is started. The process inherits the blocked signal
    and takes it once its handler is in place (jobs.runner.on_stop_signals), so that a cancel sent while it starts
    cancels it cleanly instead of killing it without a word."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def adopt(proc: subprocess.Popen[bytes]) -> None:
    """Keep a started run's process, so that its exit is collected (no zombie) and seen at once."""
    _children[proc.pid] = proc


def reap_children() -> None:
    """Collect the exit status of runs this process started that have ended (no zombies left behind)."""
    for pid, child in list(_children.items()):
        if child.poll() is not None:
            del _children[pid]


def valid_pid(pid: object) -> bool:
    """A pid that names one process: not 0 (the caller's group), -1 (every process) or 1 (init)."""
    return isinstance(pid, int) and not isinstance(pid, bool) and 1 < pid < PID_LIMIT


def proc_stat(pid: int) -> ProcStat | None:
    """None where the process (or /proc) is not there."""
    return read_stat(pid) if valid_pid(pid) else None


def proc_start_time(pid: int) -> int | None:
    """Start time of a live process in clock ticks since boot (Linux); None where /proc is not available."""
    stat = proc_stat(pid)
    return None if stat is None or stat.ended else stat.start_time


def pid_alive(pid: object, start_time: object = None) -> bool:
    """True while the process lives; a recorded start time guards against a reused pid."""
    if not valid_pid(pid):
        return False
    assert isinstance(pid, int)
    child = _children.get(pid)
    if child is not None and child.poll() is not None:
        del _children[pid]
        return False
    if proc_mounted():
        stat = proc_stat(pid)
        return stat is not None and not stat.ended and (start_time is None or stat.start_time == start_time)
    try:  # no /proc (not Linux): existence is all that can be told
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _works_on(pid: int, run_dir: Path) -> bool:
    """Whether the process's command line is one of the run's: `-m`, the job or worker module, then `run_dir`
    (a relative one read from its cwd), or a warm runner's (`-m` the job module `--warm`) working in `run_dir` (it
    moves there when it takes the run: core/runs/warm.py). A process that merely names the directory (`du`, `tar`)
    or works in it is not."""
    cmdline = read_cmdline(pid)
    if cmdline is None:
        return False
    args = [os.fsdecode(raw) for raw in cmdline.split(b"\0")]
    for i in range(1, len(args) - 2):
        if args[i] == "-m" and args[i + 1] in RUN_MODULES:
            if args[i + 2] == WARM_FLAG and args[i + 1] == JOB_MODULE:
                cwd = read_cwd(pid)
                return cwd is not None and os.path.realpath(cwd) == os.path.realpath(run_dir)
            if _names(pid, args[i + 2], run_dir):
                return True
    return False


def _names(pid: int, arg: str, run_dir: Path) -> bool:
    """Whether the process's argument `arg` is the path of `run_dir`."""
    if not arg or os.path.basename(arg.rstrip(os.sep)) != run_dir.name:
        return False
    cwd = "" if os.path.isabs(arg) else read_cwd(pid)
    return cwd is not None and os.path.realpath(os.path.join(cwd, arg)) == os.path.realpath(run_dir)


@dataclass(frozen=True)
class Claim:
    """A process that a run's files say is the run's: `leader` for the run's own process (from pid.json)."""

    pid: object
    start_time: object = None
    leader: bool = False


def unverified(claim: Claim, run_dir: Path) -> str:
    """Why the claimed process is not verifiably a live process of the run in `run_dir`; "" when it is."""
    pid = claim.pid
    if not valid_pid(pid):
        return f"{pid!r} is not the id of one process"
    assert isinstance(pid, int)
    if not proc_mounted():
        return f"process {pid} cannot be verified without /proc"
    stat = proc_stat(pid)
    if stat is None or stat.ended:
        return f"process {pid} has ended"
    if claim.start_time is not None and stat.start_time != claim.start_time:
        return f"process {pid} has ended (its pid now names another process)"
    if read_uid(pid) != os.getuid():
        return f"process {pid} belongs to another user"
    if not _works_on(pid, run_dir):
        return f"process {pid} is not one of this run's (its command line is not `-m {JOB_MODULE} {run_dir}`)"
    if claim.leader and stat.pgrp != pid:
        return f"process {pid} does not lead its process group"
    return ""


def verified(claims: Iterable[Claim], run_dir: Path) -> list[Claim]:
    """The claims that are live processes of the run."""
    return [c for c in claims if not unverified(c, run_dir)]


def send(claims: Iterable[Claim], run_dir: Path, sig: signal.Signals) -> list[int]:
    """Signal each claimed process that is verified to be the run's (the leader's whole process group); returns
    the pids signalled. Nothing else is ever signalled."""
    sent = []
    for claim in verified(claims, run_dir):
        assert isinstance(claim.pid, int)
        try:
            if claim.leader:
                os.killpg(claim.pid, sig)
            else:
                os.kill(claim.pid, sig)
        except (ProcessLookupError, PermissionError):
            continue
        sent.append(claim.pid)
    return sent
