"""Polling a telemetry source for a widget: in a thread worker, one poll at a time, never while hidden.

Mount a GpuPoller inside the widget that shows the data; the widget handles `GpuPoller.Polled` (the message
bubbles from the poller to it). The next poll is armed with `set_timer` only once a poll's message has been
handled, so polls never overlap and a busy UI slows polling down instead of queueing snapshots.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from textual import work
from textual.dom import NoScreen
from textual.message import Message
from textual.screen import Screen
from textual.timer import Timer
from textual.widget import Widget
from textual.worker import get_current_worker

from gpuopt_tui.core.telemetry.backend import TelemetrySource
from gpuopt_tui.core.telemetry.history import MIN_INTERVAL_S
from gpuopt_tui.core.telemetry.snapshot import Snapshot


class GpuPoller(Widget):
    """An invisible helper: polls `source` every `interval` seconds while its parent is on the current screen
    (and `when()` holds, if given).

    Without `when`, the first poll runs at mount whether the parent is on screen yet or not, so NVML starts (in
    the worker thread) while the app paints its first frame; but not in a screen built while another one is shown
    (ui/warmup.py): showing it wakes the poller."""

    DEFAULT_CSS = "GpuPoller { display: none; }"

    class Polled(Message):
        """A new snapshot, and how long the poll took."""

        def __init__(self, snapshot: Snapshot, seconds: float) -> None:
            super().__init__()
            self.snapshot = snapshot
            self.seconds = seconds

    def __init__(
        self,
        source: TelemetrySource,
        interval: float = 1.0,
        *,
        when: Callable[[], bool] | None = None,
        id: str | None = None,
    ) -> None:
        super().__init__(id=id)
        self.source = source
        self.interval = check_interval(interval)
        self._when = when
        self._timer: Timer | None = None
        self._missed = False  # a tick was skipped because the parent was hidden or polls were not wanted

    def on_mount(self) -> None:
        if (self._when is None or self._when()) and _screen_seen(self.screen):
            self._poll()
        else:
            self._missed = True
            self._arm()

    @work(thread=True, group="gpu-poll", exit_on_error=False)
    def _poll(self) -> None:
        worker = get_current_worker()
        started = time.perf_counter()
        try:
            snapshot = self.source.poll()
        except Exception as error:  # a source bug must not stop the panel: show it and keep polling
            snapshot = Snapshot(time=time.time(), message=f"GPU telemetry failed: {type(error).__name__}: {error}")
        if not worker.is_cancelled:
            self.post_message(self.Polled(snapshot, time.perf_counter() - started))

    def on_gpu_poller_polled(self, message: Polled) -> None:
        self._arm()  # the message goes on to the parent, which draws it

    def _arm(self) -> None:
        if self.is_attached:
            self._timer = self.set_timer(self.interval, self._tick, name="gpu-poll")

    def _tick(self) -> None:
        self._timer = None
        self._missed = not (self.parent_visible() and (self._when is None or self._when()))
        if self._missed:
            self._arm()  # only cheap checks while hidden or not wanted; no NVML call
        else:
            self._poll()

    def parent_visible(self) -> bool:
        """Whether the widget that shows the data is on the screen the user sees."""
        target = self.parent
        if not isinstance(target, Widget):
            return False
        try:
            screen = self.screen
        except NoScreen:
            return False
        return _screen_seen(screen) and (target is screen or target.is_on_screen)

    def wake(self) -> None:
        """Poll now if ticks were skipped (call it when the parent is shown again, or `when()` became true)."""
        if self._missed and self._timer is not None:
            self._timer.stop()
            self._timer = None
            self._tick()


def _screen_seen(screen: Screen) -> bool:
    """The top screen, or one below it seen through translucent screens (a modal dialog); not a screen of
    another mode or one covered by an opaque screen."""
    stack = screen.app.screen_stack
    if screen not in stack:
        return False
    above = stack[stack.index(screen) + 1 :]
    return all(s.styles.background.a < 1 for s in above)


def check_interval(interval: float) -> float:
    if interval < MIN_INTERVAL_S:
        raise ValueError(f"refresh interval must be at least {MIN_INTERVAL_S} s (got {interval:g})")
    return float(interval)
