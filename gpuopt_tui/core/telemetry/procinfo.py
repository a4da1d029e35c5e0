"""Host-side facts about the processes NVML reports: owner, command line, session; and signalling them.

NVML reports host PIDs. Inside a container without `--pid=host` those PIDs are not visible in /proc here,
so owner and command stay unknown (None) and signalling is refused rather than hitting an unrelated process.
"""

from __future__ import annotations

import os
import pwd
import signal
from dataclasses import dataclass

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.format import safe_text
from gpuopt_tui.core.runs.proc_files import read_cmdline, read_comm, read_stat, read_uid

SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM, "SIGKILL": signal.SIGKILL}


@dataclass(frozen=True)
class HostProcess:
    uid: int | None
    user: str | None
    command: str | None
    session: int | None  # session id; a run's process leads its own session


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _command(pid: int) -> str | None:
    raw = read_cmdline(pid)
    if raw is None:
        return None
    # any user can name a process anything, escape sequences included: shown with safe_text
    if raw.strip(b"\0"):
        return safe_text(raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace"))
    comm = read_comm(pid)
    return None if comm is None else "[" + safe_text(comm) + "]"


def start_time(pid: int) -> int | None:
    """When the process started, in clock ticks since boot: with the pid, it names one process for good."""
    stat = read_stat(pid)
    return None if stat is None else stat.start_time


def host_process(pid: int) -> HostProcess:
    """What /proc says about `pid`; all None when it is not visible from here."""
    uid, stat = read_uid(pid), read_stat(pid)
    return HostProcess(
        uid=uid,
        user=None if uid is None else _user_name(uid),
        command=_command(pid),
        session=None if stat is None else stat.session,
    )


def send_signal(pid: int, name: str, started: int | None = None) -> None:
    """Send SIGINT, SIGTERM or SIGKILL to a process of the current user; UserError otherwise.

    `started` (from `start_time` when the user chose the process) guards against a pid reused since."""
    if name not in SIGNALS:
        raise UserError(f"unknown signal {name!r}; expected one of {', '.join(SIGNALS)}")
    uid = read_uid(pid)
    if uid is None:
        raise UserError(f"process {pid} is not visible here (it ended, or runs in another PID namespace)")
    if uid != os.getuid():
        raise UserError(f"process {pid} belongs to {_user_name(uid)}; only your own processes can be signalled")
    if started is not None and start_time(pid) != started:
        raise UserError(f"process {pid} has ended (its pid now names another process)")
    try:
        os.kill(pid, SIGNALS[name])
    except ProcessLookupError:
        raise UserError(f"process {pid} has already ended") from None
    except PermissionError:
        raise UserError(f"not permitted to send {name} to process {pid}") from None
