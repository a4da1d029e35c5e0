"""Recent memory and utilisation per GPU, for history plots: a time-trimmed ring buffer per GPU."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from gpuopt_tui.core.telemetry.snapshot import Snapshot

MIN_INTERVAL_S = 0.25  # the shortest refresh interval anywhere in the program
SERIES = ("memory", "util")


@dataclass(frozen=True)
class _Point:
    time: float
    memory: float | None  # percent of total
    util: float | None  # SM utilisation, percent


class History:
    """Keeps the last `window_s` seconds of memory % and SM utilisation % for every GPU index seen."""

    def __init__(self, window_s: float = 300.0) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._maxlen = math.ceil(window_s / MIN_INTERVAL_S) + 1
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
        oldest = now - self.window_s
        for points in self._points.values():
            while points and points[0].time < oldest:
                points.popleft()

    def indices(self) -> list[int]:
        return sorted(self._points)

    def values(self, index: int, series: str) -> list[tuple[float, float | None]]:
        """(time, value) pairs of one series of one GPU, oldest first."""
        if series not in SERIES:
            raise ValueError(f"unknown series {series!r}; expected one of {SERIES}")
        return [(p.time, getattr(p, series)) for p in self._points.get(index, ())]

    def buckets(self, index: int, series: str, count: int, now: float | None = None) -> list[float | None]:
        """The window split into `count` equal time buckets, oldest first: the peak of each bucket, or None
        where there is no sample (before the first poll, or while the GPU was lost)."""
        if count <= 0:
            return []
        end = self.last_time if now is None else now
        if end is None:
            return [None] * count
        start = end - self.window_s
        width = self.window_s / count
        peaks: list[float | None] = [None] * count
        for t, value in self.values(index, series):
            if value is None or t < start:
                continue
            slot = min(count - 1, int((t - start) / width))
            current = peaks[slot]
            peaks[slot] = value if current is None else max(current, value)
        return peaks
