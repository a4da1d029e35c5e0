"""Recorded telemetry traces: JSONL, a header line then one snapshot a line.

Header: {"format": "gpuopt-tui-gpu-trace", "version": 1, "interval": S, "host": ..., "driver": ..., ...}.
A recorder writes and flushes one line per poll, so a trace cut short (Ctrl-C, a lost SSH session) is still
readable; a half-written last line is skipped. Every field of every sample is checked (trace_fields).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.json_line import JsonLineError, parse_json_line
from gpuopt_tui.core.telemetry.snapshot import Snapshot
from gpuopt_tui.core.telemetry.trace_fields import FieldError, shown, snapshot_from_json

TRACE_FORMAT = "gpuopt-tui-gpu-trace"
TRACE_VERSION = 1


@dataclass
class Trace:
    path: Path
    header: dict[str, Any]
    snapshots: list[Snapshot] = field(default_factory=list)

    @property
    def duration(self) -> float:
        return self.snapshots[-1].time - self.snapshots[0].time if self.snapshots else 0.0


def read_trace(path: Path) -> Trace:
    """Load a trace; UserError naming the file, line and field for anything that is not one."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as error:
        raise UserError(f"{path}: cannot read trace ({error.strerror or error})") from None
    except UnicodeDecodeError as error:
        raise UserError(f"{path}: not a GPU trace (byte {error.start} is not UTF-8 text)") from None
    # split on newlines only: a JSON string may hold other line separators (U+2028, form feed)
    lines = text.split("\n")
    cut_off = lines.pop()  # "" when the file ends with a newline; else a last line the recorder never finished
    if not any(line.strip() for line in lines) and not cut_off.strip():
        raise UserError(f"{path}: empty file, expected a GPU trace (JSONL with a '{TRACE_FORMAT}' header)")
    header = _parse(path, 1, lines[0] if lines else cut_off)
    if not isinstance(header, dict) or header.get("format") != TRACE_FORMAT:
        raise UserError(f"{path}: line 1: expected a header with format '{TRACE_FORMAT}'")
    if header.get("version") != TRACE_VERSION:
        raise UserError(
            f"{path}: line 1: trace version {shown(header.get('version'))} is not supported (expected {TRACE_VERSION})"
        )
    trace = Trace(path, header)
    for number, line in enumerate(lines[1:], start=2):
        if line.strip():
            trace.snapshots.append(_snapshot(path, number, _parse(path, number, line)))
    if lines and cut_off.strip():
        try:
            data = parse_json_line(cut_off)
        except JsonLineError:
            data = None  # a recording cut off mid-line: the samples before it stand
        if data is not None:
            trace.snapshots.append(_snapshot(path, len(lines) + 1, data))
    if not trace.snapshots:
        raise UserError(f"{path}: the trace holds no samples")
    return trace


def _parse(path: Path, number: int, line: str) -> Any:
    try:
        return parse_json_line(line)
    except JsonLineError as error:
        raise UserError(f"{path}: line {number}: invalid JSON ({error})") from None


def _snapshot(path: Path, number: int, data: Any) -> Snapshot:
    try:
        return snapshot_from_json(data)
    except FieldError as error:
        raise UserError(f"{path}: line {number}: not a GPU sample: {error}") from None


def replay(trace: Trace, speed: float | None = 1.0, sleep: Callable[[float], None] = time.sleep) -> Iterator[Snapshot]:
    """Yield the snapshots with their original spacing divided by `speed`; speed None: no waiting."""
    previous: float | None = None
    for snapshot in trace.snapshots:
        if speed is not None and previous is not None:
            gap = (snapshot.time - previous) / speed
            if gap > 0:
                sleep(gap)
        previous = snapshot.time
        yield snapshot


class Redactor:
    """Makes a trace fit to share: user names become user1, user2, ... (in order of appearance) and home
    directories in command lines become ~."""

    _HOME = re.compile(r"/(?:home|Users)/[^/\s]+")

    def __init__(self) -> None:
        self._users: dict[str, str] = {}

    def __call__(self, snapshot: Snapshot) -> Snapshot:
        processes = tuple(
            replace(p, user=self._user(p.user), command=p.command and self._HOME.sub("~", p.command))
            for p in snapshot.processes
        )
        return replace(snapshot, processes=processes)

    def _user(self, user: str | None) -> str | None:
        if user is None:
            return None
        return self._users.setdefault(user, f"user{len(self._users) + 1}")


class TraceWriter:
    """Writes a trace line by line, flushed after each snapshot. Refuses to overwrite an existing file."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        try:
            self._file: TextIO = path.open("x", encoding="utf-8")
        except FileExistsError:
            raise UserError(f"{path}: already exists; choose another name for the trace") from None
        except OSError as error:
            raise UserError(f"{path}: cannot create trace ({error.strerror or error})") from None
        self._write({"format": TRACE_FORMAT, "version": TRACE_VERSION, **header})
        self.count = 0

    def _write(self, data: dict[str, Any]) -> None:
        self._file.write(json.dumps(data, separators=(",", ":")) + "\n")
        self._file.flush()

    def write(self, snapshot: Snapshot) -> None:
        self._write(snapshot.to_dict())
        self.count += 1

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
