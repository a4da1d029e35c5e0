"""The events.jsonl protocol between a run's process and whoever watches it.

One JSON object a line, append-only, flushed after each line. Every event has `t` (unix time) and `type`, one
of EVENT_TYPES (below: the only list of them; a test checks it against every event the source writes).
Readers tolerate a half-written last line (it is read again once complete), skip corrupt lines, counting
them, and drop fields of the wrong type (see `clean_event`).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from gpuopt_tui.core.format import safe_text

# The run's own process: `started` (pid, attempt, kind, host), then one of the terminal types (`finished` with the
# engine's summary, `failed` or `cancelled` with a message).
TERMINAL_TYPES = frozenset({"finished", "failed", "cancelled"})
LIFECYCLE_TYPES = TERMINAL_TYPES | {"started"}
# Each worker of a run over several processes, stamped with its `rank`: `rank_started` (pid, start_time, host,
# device), then its own end, `rank_finished`, `rank_failed` or `rank_cancelled`.
RANK_END_TYPES = frozenset(f"rank_{t}" for t in TERMINAL_TYPES)
RANK_TYPES = RANK_END_TYPES | {"rank_started"}
# What a job reports on its way (jobs/context.py): `progress` (done, total, unit, rate, eta, stage, GPU memory),
# `log` (level, message), `warning` (message), `metric` (name, value), `artifact` (path, description) and
# `startup` (stage, seconds, at: one per start-up stage as it ends, up to the first computed batch;
# core/runs/startup.py).
REPORT_TYPES = frozenset({"progress", "log", "warning", "metric", "artifact", "startup"})
# What an engine says about how it adapted to the hardware: `compiled` / `compile_failed` (torch.compile of the
# attribution step), `chunk_probe` / `batch_probe` (the memory probe that sizes an "auto" chunk or micro-batch),
# `oom_retry` (a chunk or micro-batch halved after running out of memory), `oom_split` (a batch of samples split
# in two after the same), `fp16_overflow` (a batch redone in float32).
ENGINE_TYPES = frozenset(
    {"compiled", "compile_failed", "chunk_probe", "batch_probe", "oom_retry", "oom_split", "fp16_overflow"}
)
EVENT_TYPES = LIFECYCLE_TYPES | RANK_TYPES | REPORT_TYPES | ENGINE_TYPES
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
        if type not in EVENT_TYPES:
            raise ValueError(f"{type!r} is not an event type (see EVENT_TYPES)")
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


# Known fields and the type each must have: a field of another type (a damaged or hand-edited file) is dropped,
# so every reader can use what it finds without checking it again.
_INT_FIELDS = frozenset({"rank", "pid", "start_time", "attempt", "nodes"})
_NUMBER_FIELDS = frozenset(
    {"t", "done", "total", "rate", "eta", "gpu_allocated", "gpu_reserved", "gpu_peak", "seconds", "at"}
)
_TEXT_FIELDS = frozenset({"message", "host", "device", "stage", "unit", "path", "kind", "scale", "level"})
_DICT_FIELDS = frozenset({"summary"})

CHUNK_BYTES = 1 << 20  # events files are read a block at a time: memory stays bounded whatever their size
MAX_LINE_BYTES = 4 << 20  # a longer "line" is damage, not an event
SKIM_OVER_BYTES = 8 << 20  # a skimming reader with more than this to read ...
KEEP_TAIL_BYTES = 256 << 10  # ... parses every line of only the last this many bytes (minutes of progress)
_TYPE_NOT_PROGRESS = re.compile(rb'"type"\s*:\s*"(?!progress")')


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def clean_event(event: dict[str, Any]) -> dict[str, Any]:
    """`event` without known fields of the wrong type, without numbers that are not finite (NaN, Infinity),
    and with its text made safe to show."""
    clean: dict[str, Any] = {}
    for key, value in event.items():
        if key in _INT_FIELDS:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif key in _NUMBER_FIELDS:
            ok = _is_number(value)
        elif key in _DICT_FIELDS:
            ok = isinstance(value, dict)
        elif key in _TEXT_FIELDS:
            ok, value = True, safe_text(value) if isinstance(value, str) else safe_text(json.dumps(value, default=str))
        else:
            ok = not isinstance(value, float) or math.isfinite(value)
        if ok:
            clean[key] = value
    return clean


@dataclass
class EventTail:
    """Incremental reader of an events file: call `read()` repeatedly to get new events.

    A `skim`ming reader (one that folds events into a status) facing a large backlog (a long run's file read
    for the first time) skips the progress events before the last KEEP_TAIL_BYTES without parsing them (and
    lines that name no type): only the latest progress matters to it, and every other event is still read.
    `error` says why the file could not be read ("" when it could, or does not exist yet).
    """

    path: Path
    skim: bool = False
    offset: int = 0
    corrupt_lines: int = 0
    error: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)

    def read(self) -> list[dict[str, Any]]:
        """New complete events since the last call (also appended to `self.events`)."""
        new: list[dict[str, Any]] = []
        try:
            with self.path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                skim_before = size - KEEP_TAIL_BYTES if self.skim and size - self.offset > SKIM_OVER_BYTES else 0
                f.seek(self.offset)
                partial = b""
                while block := f.read(CHUNK_BYTES):
                    data = partial + block
                    end = data.rfind(b"\n") + 1
                    if end:
                        cut = data.rfind(b"\n", 0, max(0, skim_before - self.offset)) + 1  # whole lines skimmed
                        self._parse(data[:cut], new, skim=True)
                        self._parse(data[cut:end], new, skim=False)
                        self.offset += end
                        partial = data[end:]
                    else:
                        partial = data
                    if len(partial) > MAX_LINE_BYTES:  # the rest of this line, up to its end, is corrupt too
                        self.corrupt_lines += 1
                        self.offset += len(partial)
                        partial = b""
            self.error = ""
        except FileNotFoundError:
            self.error = ""  # not written yet
        except OSError as e:
            self.error = f"cannot read {self.path.name} ({e.strerror or e})"
        self.events.extend(new)
        return new

    def _parse(self, lines: bytes, new: list[dict[str, Any]], skim: bool) -> None:
        """Parse whole lines; skimming, only those whose type is not "progress" (found without parsing)."""
        if not skim:
            for raw in lines.splitlines():
                self._parse_line(raw, new)
            return
        end = 0
        for match in _TYPE_NOT_PROGRESS.finditer(lines):
            if match.start() >= end:  # the first "type" of a line
                start = lines.rfind(b"\n", 0, match.start()) + 1
                end = lines.find(b"\n", match.end())
                self._parse_line(lines[start:end], new)

    def _parse_line(self, raw: bytes, new: list[dict[str, Any]]) -> None:
        if not raw.strip():
            return
        try:
            event = json.loads(raw)
        except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            self.corrupt_lines += 1
            return
        if isinstance(event, dict) and isinstance(event.get("type"), str):
            new.append(clean_event(event))
        else:
            self.corrupt_lines += 1


def read_events(path: Path, skim: bool = False) -> tuple[list[dict[str, Any]], int]:
    """All complete events of a file (see EventTail for `skim`) and the number of corrupt lines skipped."""
    tail = EventTail(path, skim=skim)
    tail.read()
    return tail.events, tail.corrupt_lines
