"""Host-side facts about the processes NVML reports: owner, command line, session; and signalling them.

NVML reports host PIDs. Inside a container without `--pid=host` those PIDs are not visible in /proc here,
so owner and command stay unknown (None) and signalling is refused rather than hitting an unrelated process.
"""

from __future__ import annotations

import os
import pwd
import signal
from dataclasses import dataclass
from pathlib import Path

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.format import safe_text

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


def _uid(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])  # the real uid
    except (OSError, ValueError, IndexError):
        pass
    return None


def _command(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    # any user can name a process anything, escape sequences included: shown with safe_text
    if raw.strip(b"\0"):
        return safe_text(raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace"))
    try:
        return "[" + safe_text(Path(f"/proc/{pid}/comm").read_text(errors="replace").strip()) + "]"
    except OSError:
        return None


def _stat_field(pid: int, position: int) -> int | None:
    """A numeric field of /proc/PID/stat, counted from the one after the command name (0 = state)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[position])
    except (OSError, ValueError, IndexError):
        return None


def _session(pid: int) -> int | None:
    return _stat_field(pid, 3)  # state ppid pgrp session


def start_time(pid: int) -> int | None:
    """When the process started, in clock ticks since boot: with the pid, it names one process for good."""
    return _stat_field(pid, 19)


def host_process(pid: int) -> HostProcess:
    """What /proc says about `pid`; all None when it is not visible from here."""
    uid = _uid(pid)
    return HostProcess(
        uid=uid,
        user=None if uid is None else _user_name(uid),
        command=_command(pid),
        session=_session(pid),
    )


def send_signal(pid: int, name: str, started: int | None = None) -> None:
    """Send SIGINT, SIGTERM or SIGKILL to a process of the current user; UserError otherwise.

    `started` (from `start_time` when the user chose the process) guards against a pid reused since."""
    if name not in SIGNALS:
        raise UserError(f"unknown signal {name!r}; expected one of {', '.join(SIGNALS)}")
    uid = _uid(pid)
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
