"""What Linux's /proc says about a process: the one place that reads /proc/PID/stat and /proc/PID/status.

Every reader returns None where the process (or /proc) is not there: it ended, runs in another PID namespace,
or this is not Linux.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
Pid = int | str  # a process id, or "self"


@dataclass(frozen=True)
class ProcStat:
    """The fields of /proc/PID/stat that gpuopt-tui uses."""

    state: str  # R, S, D, ..., Z (zombie: ended, not yet reaped), X (dead)
    pgrp: int
    session: int  # a run's process leads its own session
    start_time: int  # clock ticks since boot: with the pid, it names one process for good

    @property
    def ended(self) -> bool:
        return self.state in ("Z", "X")


def proc_mounted() -> bool:
    return (PROC / "self" / "stat").exists()


def read_stat(pid: Pid) -> ProcStat | None:
    try:
        # the command name, in parentheses, may hold anything, spaces and ")" included: the fields follow its last ")"
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        return ProcStat(state=fields[0], pgrp=int(fields[2]), session=int(fields[3]), start_time=int(fields[19]))
    except (OSError, ValueError, IndexError):
        return None


def read_uid(pid: Pid) -> int | None:
    """The real user id of the process."""
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def read_cmdline(pid: Pid) -> bytes | None:
    """The command line, its arguments separated by NUL bytes (empty for a kernel thread)."""
    try:
        return (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None


def read_comm(pid: Pid) -> str | None:
    """The command name (what a kernel thread is known by)."""
    try:
        return (PROC / str(pid) / "comm").read_text(errors="replace").strip()
    except OSError:
        return None


def read_cwd(pid: Pid) -> str | None:
    try:
        return os.readlink(PROC / str(pid) / "cwd")
    except OSError:
        return None


def seconds_running(pid: Pid = "self") -> float | None:
    """Seconds since the process started."""
    stat = read_stat(pid)
    try:
        uptime = float((PROC / "uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return None if stat is None else uptime - stat.start_time / os.sysconf("SC_CLK_TCK")
