"""Watches the run directories off the UI thread.

One poll at a time: a thread worker reads the runs (RunWatcher reads only new events), posts `RunsPolled` to the
app, and the next poll is armed with `set_timer` only once that message has been handled, so polls never
overlap and a slow disk slows the polling instead of piling it up. Nothing is redrawn when nothing changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from textual.app import App
from textual.message import Message
from textual.timer import Timer

from gpuopt_tui.core.runs.status import RunInfo, RunWatcher
from gpuopt_tui.core.runs.warm import ready_runners

ACTIVE_INTERVAL_S = 0.5  # while a run is starting or running
IDLE_INTERVAL_S = 1.0
ERROR_INTERVAL_S = 5.0  # after a poll raised an unexpected error (reported once by the app)


@dataclass(frozen=True)
class RunsSnapshot:
    """Every run as last read, newest first, why the runs directory could not be read (if so), and the pids of the
    warm runners ready (core/runs/warm.py)."""

    root: Path
    runs: tuple[RunInfo, ...] = ()
    error: str = ""
    warm: tuple[int, ...] = ()

    def get(self, run_id: str) -> RunInfo | None:
        return next((r for r in self.runs if r.id == run_id), None)

    def latest(self, kind: str) -> RunInfo | None:
        return next((r for r in self.runs if r.kind == kind), None)

    @property
    def any_active(self) -> bool:
        return any(r.active for r in self.runs)


class RunsPolled(Message):
    """A poll finished: `snapshot` is None when it raised (the worker error handler reports why)."""

    def __init__(self, snapshot: RunsSnapshot | None, changed: bool) -> None:
        super().__init__()
        self.snapshot = snapshot
        self.changed = changed


class RunPoller:
    """Polls `root` for the app; the app calls `handled()` from its `RunsPolled` handler to arm the next poll."""

    def __init__(self, app: App[object], root: Path) -> None:
        self._app = app
        self._watcher = RunWatcher(root)
        self._last = RunsSnapshot(root)  # read and written by the poll thread only
        self._in_flight = False
        self._again = False
        self._timer: Timer | None = None

    @property
    def root(self) -> Path:
        return self._watcher.root

    def poll_now(self) -> None:
        """Poll as soon as possible (after starting or cancelling a run), never two polls at once."""
        if self._in_flight:
            self._again = True
            return
        if self._timer is not None:
            self._timer.stop()
            self._timer = None
        self._in_flight = True
        self._app.run_worker(self._poll, name="runs poll", group="run-poll", thread=True, exit_on_error=False)

    def handled(self, message: RunsPolled) -> None:
        self._in_flight = False
        if self._again:
            self._again = False
            self.poll_now()
            return
        if message.snapshot is None:
            interval = ERROR_INTERVAL_S
        else:
            interval = ACTIVE_INTERVAL_S if message.snapshot.any_active else IDLE_INTERVAL_S
        self._timer = self._app.set_timer(interval, self.poll_now, name="runs poll timer")

    def _poll(self) -> None:
        snapshot: RunsSnapshot | None = None
        changed = False
        try:
            snapshot = self._read()
            changed = snapshot != self._last
            self._last = snapshot
        finally:
            self._app.post_message(RunsPolled(snapshot, changed))

    def _read(self) -> RunsSnapshot:
        warm = tuple(runner.pid for runner in ready_runners())
        try:
            return RunsSnapshot(self.root, tuple(self._watcher.refresh()), warm=warm)
        except OSError as e:
            # keep showing what was read before; say why it is stale
            error = f"cannot read the runs directory {self.root} ({e.strerror or e})"
            return RunsSnapshot(self.root, self._last.runs, error, warm)
