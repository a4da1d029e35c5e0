"""The events.jsonl protocol between a run's process and whoever watches it.

One JSON object a line, append-only, flushed after each line. Every event has `t` (unix time) and `type`.
Types: started, progress, metric, log, artifact, warning, finished, failed, cancelled, resumed.
Readers tolerate a half-written last line (it is read again once complete) and skip corrupt lines,
counting them.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

TERMINAL_TYPES = frozenset({"finished", "failed", "cancelled"})
PROGRESS_INTERVAL_S = 0.25  # at most ~4 progress events a second


class EventWriter:
    """Appends events to a run's events.jsonl; progress events are throttled. `stamp` fields go into every
    event (the `rank` of a worker of a run over several processes: they all append to the same file, one
    whole line per write)."""

    def __init__(self, path: Path, **stamp: Any) -> None:
        self.path = path
        self._file: TextIO = path.open("a", encoding="utf-8")
        self._last_progress = 0.0
        self._stamp = stamp

    def emit(self, type: str, **fields: Any) -> dict[str, Any]:
        event = {"t": round(time.time(), 3), "type": type, **self._stamp, **fields}
        self._file.write(json.dumps(event, default=str) + "\n")
        self._file.flush()
        return event

    def progress(self, force: bool = False, **fields: Any) -> bool:
        """Write a progress event unless one was written less than PROGRESS_INTERVAL_S ago."""
        now = time.monotonic()
        if not force and now - self._last_progress < PROGRESS_INTERVAL_S:
            return False
        self._last_progress = now
        self.emit("progress", **fields)
        return True

    def sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


@dataclass
class EventTail:
    """Incremental reader of an events file: call `read()` repeatedly to get new events."""

    path: Path
    offset: int = 0
    corrupt_lines: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)

    def read(self) -> list[dict[str, Any]]:
        """New complete events since the last call (also appended to `self.events`)."""
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        new: list[dict[str, Any]] = []
        for raw in chunk[: end + 1].splitlines():
            if not raw.strip():
                continue
            try:
                event = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                self.corrupt_lines += 1
                continue
            if isinstance(event, dict) and isinstance(event.get("type"), str):
                new.append(event)
            else:
                self.corrupt_lines += 1
        self.events.extend(new)
        return new


def read_events(path: Path) -> tuple[list[dict[str, Any]], int]:
    """All complete events of a file and the number of corrupt lines skipped."""
    tail = EventTail(path)
    tail.read()
    return tail.events, tail.corrupt_lines
