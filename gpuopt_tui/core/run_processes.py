"""The processes of a run: how they are started, whether they live, and signalling only those that are the run's.

A pid read from a run directory (`pid.json`, a worker's `rank_started` event) is only a claim: the file may be
stale (the pid since reused by another process), damaged or planted. A process is signalled only when it is
verified to be the run's: a real pid (above 1: never 0, -1 or init), alive, owned by this user, started at the
recorded time (when one was recorded), and running with the run directory as an argument (the run's process is
`python -m gpuopt_tui.jobs RUN_DIR`; torchrun and its workers `... -m gpuopt_tui.jobs.worker RUN_DIR`). The run's
own process must also lead its process group, which is what it is signalled through (the group holds torchrun).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
PID_LIMIT = 2**31  # os.kill takes a C int
# Where the run's processes start. `python -m` puts its working directory first on sys.path (Python 3.10 has no
# -P / PYTHONSAFEPATH), so it must be one that only root can write to: never the run directory.
NEUTRAL_CWD = os.sep
_children: dict[int, subprocess.Popen[bytes]] = {}  # processes this process started, reaped when polled


def job_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a run's processes: unbuffered output, and no working directory on sys.path (Python
    3.11+; PYTHONPATH keeps working)."""
    return dict(os.environ if base is None else base, PYTHONUNBUFFERED="1", PYTHONSAFEPATH="1")


def adopt(proc: subprocess.Popen[bytes]) -> None:
    """Keep a started run's process, so that its exit is collected (no zombie) and seen at once."""
    _children[proc.pid] = proc


def reap_children() -> None:
    """Collect the exit status of runs this process started that have ended (no zombies left behind)."""
    for pid, child in list(_children.items()):
        if child.poll() is not None:
            del _children[pid]


@dataclass(frozen=True)
class ProcStat:
    """What /proc/PID/stat says about a process."""

    state: str  # R, S, D, ..., Z (zombie: ended, not yet reaped), X (dead)
    pgrp: int
    start_time: int  # clock ticks since boot: with the pid, it names one process for good

    @property
    def ended(self) -> bool:
        return self.state in ("Z", "X")


def valid_pid(pid: object) -> bool:
    """A pid that names one process: not 0 (the caller's group), -1 (every process) or 1 (init)."""
    return isinstance(pid, int) and not isinstance(pid, bool) and 1 < pid < PID_LIMIT


def proc_stat(pid: int) -> ProcStat | None:
    """None where the process (or /proc) is not there."""
    if not valid_pid(pid):
        return None
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        return ProcStat(fields[0], int(fields[2]), int(fields[19]))
    except (OSError, ValueError, IndexError):
        return None


def proc_start_time(pid: int) -> int | None:
    """Start time of a live process in clock ticks since boot (Linux); None where /proc is not available."""
    stat = proc_stat(pid)
    return None if stat is None or stat.ended else stat.start_time


def _proc_mounted() -> bool:
    return (PROC / "self" / "stat").exists()


def pid_alive(pid: object, start_time: object = None) -> bool:
    """True while the process lives; a recorded start time guards against a reused pid."""
    if not valid_pid(pid):
        return False
    assert isinstance(pid, int)
    child = _children.get(pid)
    if child is not None and child.poll() is not None:
        del _children[pid]
        return False
    if _proc_mounted():
        stat = proc_stat(pid)
        return stat is not None and not stat.ended and (start_time is None or stat.start_time == start_time)
    try:  # no /proc (not Linux): existence is all that can be told
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _uid(pid: int) -> int | None:
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])  # the real uid
    except (OSError, ValueError, IndexError):
        pass
    return None


def _works_on(pid: int, run_dir: Path) -> bool:
    """Whether the process was started with `run_dir` as an argument (a relative one read from its cwd)."""
    try:
        args = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")[1:]
    except OSError:
        return False
    target = os.path.realpath(run_dir)
    for raw in args:
        arg = os.fsdecode(raw)
        if not arg or os.path.basename(arg.rstrip(os.sep)) != run_dir.name:
            continue
        try:
            full = arg if os.path.isabs(arg) else os.path.join(os.readlink(PROC / str(pid) / "cwd"), arg)
        except OSError:
            continue
        if os.path.realpath(full) == target:
            return True
    return False


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
    if not _proc_mounted():
        return f"process {pid} cannot be verified without /proc"
    stat = proc_stat(pid)
    if stat is None or stat.ended:
        return f"process {pid} has ended"
    if claim.start_time is not None and stat.start_time != claim.start_time:
        return f"process {pid} has ended (its pid now names another process)"
    if _uid(pid) != os.getuid():
        return f"process {pid} belongs to another user"
    if not _works_on(pid, run_dir):
        return f"process {pid} is not one of this run's (it was not started on {run_dir})"
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
