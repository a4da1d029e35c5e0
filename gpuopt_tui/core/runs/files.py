"""Reading a run directory's own files without trusting them: any of them may be damaged, hand-edited or planted.

Every reader here returns what it could read and, where it could not, why, in words to show beside the run;
none raises on bad content. Text read from these files is made safe to show (`safe_text`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.format import human_bytes, safe_text
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.processes import pid_alive

MAX_JSON_BYTES = 1 << 20  # meta.json and pid.json are a few hundred bytes
LOW_SPACE_BYTES = 1 << 20  # less free space than this on a run's disk: it cannot start
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_PARTIAL_WRITE = re.compile(r"\..+\.(\d+)\.tmp")  # core.atomic.write_atomically's temporary file


def check_run_id(run_id: str) -> None:
    """Run ids are plain names inside the runs directory, never paths."""
    if not _RUN_ID.fullmatch(run_id):
        raise UserError(
            f"{safe_text(run_id)!r} is not a run id: ids are plain names such as 20250101-120000-attribution-1a2b "
            "(letters, digits, '.', '_' and '-'; see `gpuopt-tui runs`)"
        )


def shown(value: object) -> str:
    """A value read from a file, as an error message quotes it: short, and safe to show."""
    text = json.dumps(value, default=str) if not isinstance(value, str) else json.dumps(value)
    return safe_text(text if len(text) <= 40 else text[:39] + "…")


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_object(path: Path) -> tuple[dict[str, Any] | None, str]:
    """A file holding one JSON object, or None and why it cannot be used ("" when it does not exist)."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        return None, ""
    except IsADirectoryError:
        return None, f"{path.name} is a directory, not a file"
    except OSError as e:
        return None, f"cannot read {path.name} ({e.strerror or e})"
    if len(data) > MAX_JSON_BYTES:
        return None, f"{path.name} is larger than {human_bytes(MAX_JSON_BYTES)}: not one of gpuopt-tui's"
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None, f"{path.name} is not valid JSON ({safe_text(e)})"
    if not isinstance(value, dict):
        return None, f"{path.name} holds {shown(value)}, not a JSON object"
    return value, ""


def meta_problem(meta: dict[str, Any]) -> str:
    """What is wrong with a run's meta.json ("" when nothing is)."""
    kind = meta.get("kind")
    if not isinstance(kind, str) or not kind:
        return f"{RunDir.META}: 'kind' is {shown(kind)}; expected a run kind such as \"attribution\""
    created = meta.get("created")
    if not is_number(created):
        return f"{RunDir.META}: 'created' is {shown(created)}; expected a time in seconds since 1970"
    for key in ("id", "name", "source"):
        if key in meta and not isinstance(meta[key], str):
            return f"{RunDir.META}: '{key}' is {shown(meta[key])}; expected text"
    return ""


def pid_record_problem(record: dict[str, Any]) -> str:
    """What is wrong with a run's pid.json ("" when nothing is)."""
    checks = (
        ("pid", lambda v: v is None or (is_int(v) and v >= 0), "a process id"),
        ("start_time", lambda v: v is None or is_int(v), "a start time in clock ticks, or null"),
        ("attempt", lambda v: is_int(v) and v >= 0, "an attempt number"),
        ("host", lambda v: isinstance(v, str), "a host name"),
    )
    for key, ok, expected in checks:
        if key in record and not ok(record[key]):
            return f"{RunDir.PID}: '{key}' is {shown(record[key])}; expected {expected}"
    return ""


def crash_message(run_dir: Path) -> str:
    """Why a run's process may have ended without a word: an empty log says more than "see its log"."""
    said = "the run's process ended without reporting why"
    try:
        if RunDir(run_dir).log.stat().st_size > 0:
            return f"{said}; see its log"
    except OSError:
        pass
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        free = None
    if free is not None and free < LOW_SPACE_BYTES:
        return f"{said}, and its log is empty: the disk of {run_dir} is full ({human_bytes(free)} free)"
    return f"{said}, and its log is empty (it was killed, or could not write to {run_dir})"


def check_free_space(run_dir: Path) -> None:
    """A run needs room for its log, events and results: refuse to start one on a full disk."""
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        return  # the launch itself reports what is wrong with the directory
    if free < LOW_SPACE_BYTES:
        raise UserError(f"the disk of {run_dir} is full ({human_bytes(free)} free): free some space, then resume")


def log_tail(run_dir: Path, lines: int = 20) -> list[str]:
    """The last `lines` lines of the run's log.txt, safe to show."""
    path = RunDir(run_dir).log
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return [safe_text(line) for line in text.splitlines()[-lines:]] if lines > 0 else []


def is_partial_write(path: Path) -> bool:
    """A temporary file of a write in progress, or of one that was killed (core.atomic names them `.NAME...tmp`)."""
    return path.name.startswith(".") and path.name.endswith(".tmp")


def result_files(run_dir: Path) -> list[Path]:
    """The run's result files, without temporary ones."""
    try:
        return sorted(p for p in RunDir(run_dir).results.iterdir() if p.is_file() and not is_partial_write(p))
    except OSError:
        return []


def remove_stale_partial_writes(run_dir: Path) -> None:
    """Remove the temporary files that writers killed mid-write left behind (their pid is not alive here)."""
    for folder in (RunDir(run_dir).results, RunDir(run_dir).state):
        with contextlib.suppress(OSError):
            for path in folder.iterdir():
                match = _PARTIAL_WRITE.fullmatch(path.name)
                if match and not pid_alive(int(match.group(1))):
                    path.unlink(missing_ok=True)


@contextlib.contextmanager
def run_lock(run_dir: Path, doing: str) -> Iterator[None]:
    """Hold the run's lock (its `.lock` file) for a check-and-act, e.g. resume; UserError if another process
    holds it."""
    try:
        fd = os.open(RunDir(run_dir).lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise UserError(f"cannot lock run {run_dir.name} ({e.strerror or e})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"run {run_dir.name} is being {doing} by another process; try again") from None
        yield
    finally:
        os.close(fd)
