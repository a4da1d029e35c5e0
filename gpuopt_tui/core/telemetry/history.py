"""Recent memory and utilisation per GPU, for history plots: a time-trimmed ring buffer per GPU."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from gpuopt_tui.core.telemetry.snapshot import Snapshot

MIN_INTERVAL_S = 0.25  # the shortest refresh interval anywhere in the program
SERIES = ("memory", "util")
# Points are kept for twice the window: plots end at the last complete column, up to a column before the last
# point, and their oldest column must still have all its points.
_RETAIN = 2


def _check(series: str) -> None:
    if series not in SERIES:
        raise ValueError(f"unknown series {series!r}; expected one of {SERIES}")


@dataclass(frozen=True)
class _Point:
    time: float
    memory: float | None  # percent of total
    util: float | None  # SM utilisation, percent


class History:
    """Memory % and SM utilisation % of every GPU index seen, over the last `window_s` seconds."""

    def __init__(self, window_s: float = 300.0) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._maxlen = math.ceil(_RETAIN * window_s / MIN_INTERVAL_S) + 1
        self._points: dict[int, deque[_Point]] = {}
        self.last_time: float | None = None

    def add(self, snapshot: Snapshot) -> bool:
        """Record a snapshot; one that is not newer than the last recorded is ignored (returns False)."""
        if self.last_time is not None and snapshot.time <= self.last_time:
            return False
        self.last_time = snapshot.time
        for gpu in snapshot.gpus:
            points = self._points.setdefault(gpu.index, deque(maxlen=self._maxlen))
            util = None if gpu.lost or gpu.util_sm is None else float(gpu.util_sm)
            memory = None if gpu.lost else gpu.memory_percent
            points.append(_Point(snapshot.time, memory, util))
        self._trim(snapshot.time)
        return True

    def _trim(self, now: float) -> None:
        oldest = now - _RETAIN * self.window_s
        for points in self._points.values():
            while points and points[0].time < oldest:
                points.popleft()

    def indices(self) -> list[int]:
        return sorted(self._points)

    def values(self, index: int, series: str) -> list[tuple[float, float | None]]:
        """(time, value) pairs of one series of one GPU over the window, oldest first."""
        _check(series)
        oldest = (self.last_time or 0.0) - self.window_s
        return [(p.time, getattr(p, series)) for p in self._points.get(index, ()) if p.time >= oldest]

    def _column_of(self, time: float, count: int) -> int:
        """Timeline index of the column of window_s / count seconds that holds `time`."""
        return math.floor(time / (self.window_s / count))

    def sweep(self, index: int, series: str, count: int) -> list[float | None]:
        """The columns of `columns` in place, as a sweeping plot draws them: column k of the timeline at position
        k mod count, so that a completed column replaces the one from a window earlier and nothing else moves;
        the position of the column in progress is blank (the plot's "now")."""
        peaks = self.columns(index, series, count)
        if not peaks or self.last_time is None:
            return peaks
        first = self._column_of(self.last_time, count) - count  # timeline index of peaks[0]
        placed: list[float | None] = [None] * count
        for offset, value in enumerate(peaks[1:], start=1):  # peaks[0] sits where the column in progress goes
            placed[(first + offset) % count] = value
        return placed

    def columns(self, index: int, series: str, count: int) -> list[float | None]:
        """The window as `count` columns of window_s / count seconds each, oldest first: the peak of each column,
        or None where there is no sample (before the first poll, or while the GPU was lost). Columns start at
        multiples of their length and only complete ones are given, so a column never changes once shown and
        the plot moves on only when a column completes (the latest values are for the figures beside it)."""
        _check(series)
        if count <= 0:
            return []
        if self.last_time is None:
            return [None] * count
        end = self._column_of(self.last_time, count)  # complete columns: end - count .. end - 1
        peaks: list[float | None] = [None] * count
        for point in self._points.get(index, ()):
            value = getattr(point, series)
            slot = self._column_of(point.time, count) - end + count
            if value is None or not 0 <= slot < count:
                continue
            current = peaks[slot]
            peaks[slot] = value if current is None else max(current, value)
        return peaks
