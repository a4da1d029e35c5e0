"""Screens made ready before they are first shown, in the idle time after the app's first frame.

A screen's first showing would otherwise do all of this while the user waits: import its modules, read its
profiles, compose and mount its widgets, lay them out and render every line for the first time (150-400 ms a
screen on a 2-core machine, against 10-40 ms to show it again). After the first frame a thread imports the screen
modules and reads the profiles; then the UI thread builds the screens not shown yet one at a time, in short steps
(build: the widgets compose and mount themselves in the pause after it; lay out; render into the widgets' line
caches, nothing written to the terminal) with a pause between steps. No step starts while screens are being
switched (and for QUIET_S after), so a key press waits for one step at most; a screen the user opens before its
turn is built by showing it, as without warm-up. The thread holds back likewise between two modules and before the
profiles (0.2-0.3 s of CPU in all): a switch would otherwise share the CPU with imports and reads for other screens
(on keys pressed at once from the first frame, the kind screens' first visits came 10-20% slower at p95); the
switch imports what its own screen needs, and each later first visit finds that done.

The garbage collector is frozen after each step, and once a screen the user reached first is shown: the screens
and modules live as long as the app, and a full collection walking them all again would cost 40-100 ms each time
it comes (`gpuopt-tui` also starts with the
collector off until the first frame, see cli.run_tui).

Textual has no public call to build a screen without showing it: `build` registers it in its mode as
`App._init_mode` does, and `lay_out` and `render` do what showing it would without the write to the terminal,
through Textual internals (ui/textual_internals.py): where this Textual lacks one, there is no warm-up and each
screen is built on its first showing.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import TYPE_CHECKING

from textual.worker import get_current_worker

from gpuopt_tui.ui.screens.base import AppScreen
from gpuopt_tui.ui.screens.registry import SCREENS, screen_modules
from gpuopt_tui.ui.textual_internals import (
    WARM_UP,
    enabled,
    messages_waiting,
    mode_started,
    put_in_mode,
    refresh_layout,
    render_lines,
    start_screen,
)

if TYPE_CHECKING:
    from textual.worker import Worker

    from gpuopt_tui.app import GpuOptApp

STEP_PAUSE_S = 0.05  # idle time left between two steps, for keys and polls
STOP_WAIT_S = 2.0  # the longest the app's shutdown waits for a screen being built
QUIET_S = 0.3  # no warm-up work starts within this time after a screen switch
# the slowest to build first; the dashboard is built at start-up, and help is text built when asked for
WARMED = ("planner", "attribution", "tracin", "ablation", "runs", "gpu")
RESULTS_PREFIX = "results-"  # then each run kind's results screen (ui/screens/results.py), kept by the app


def _settled(screen: AppScreen) -> bool:
    """Whether the screen is mounted and it and its widgets have no message waiting."""
    pumps = [screen, *screen.walk_children()]
    return screen.is_mounted and not messages_waiting(pumps)


class ScreenWarmup:
    """Imports, reads, builds, lays out and renders what the screens of WARMED need, then each run kind's results
    screen, a step at a time."""

    def __init__(self, app: GpuOptApp) -> None:
        self.app = app
        self._quiet_from = 0.0  # monotonic time from which warm-up work may start
        self._reading: Worker[None] | None = None
        self._built: dict[str, AppScreen] = {}
        self._finished = False
        self._preferred: set[str] = set()  # screens moved to the front (prefer_results): skipped at their turn
        self._steps: Iterator[Callable[[], None]] = itertools.chain(self._steps_of(WARMED), self._results_steps())

    def _steps_of(self, names: Iterable[str]) -> Iterator[Callable[[], None]]:
        return (
            partial(step, name)
            for name in names
            for step in (self.build, self.lay_out, self.render)
            if name not in self._preferred
        )

    def prefer_results(self, kind: str) -> None:
        """Make the results screen of run kind `kind` before the others (the Runs screen's highlighted run is one)."""
        name = RESULTS_PREFIX + kind
        if self._finished or name in self._preferred or name in self._built:
            return
        self._preferred.add(name)
        ahead = [partial(step, name) for step in (self.build, self.lay_out, self.render)]
        self._steps = itertools.chain(ahead, self._steps)

    def _results_steps(self) -> Iterator[Callable[[], None]]:
        from gpuopt_tui.core.kinds import KINDS  # the profile modules: imported by the reading thread by then

        yield from self._steps_of(RESULTS_PREFIX + kind for kind in KINDS)

    @property
    def done(self) -> bool:
        return self._finished

    def start(self) -> None:
        """Call after the first frame: collects garbage again, then reads in a thread and builds."""
        gc.freeze()
        gc.enable()
        self._reading = self.app.run_worker(self._read, name="loading screens", thread=True, exit_on_error=False)

    def hold(self) -> None:
        """Call before showing a screen the warm-up does not build (a run's results): its work waits until QUIET_S
        after this, leaving the CPU to that screen."""
        self._quiet_from = time.monotonic() + QUIET_S

    def switching_to(self, name: str) -> None:
        """Call before switching to mode `name`: warm-up work waits until QUIET_S after it; a screen being built
        for the mode is the one shown; a screen built by this switch is frozen once shown, as the warm-up's are."""
        self.hold()
        if name in self._built:
            self.claim(name)
        elif not mode_started(self.app, name):
            self.app.call_after_refresh(gc.freeze)

    def _busy(self) -> bool:
        return time.monotonic() < self._quiet_from

    def _read(self) -> None:
        """Thread work: import the screen modules, then read every kind's profiles, then import what reading a
        finished run's results needs."""
        from gpuopt_tui.ui.profile_listing import prefetch  # the profile modules: not needed for the first frame

        worker = get_current_worker()
        for module in screen_modules():
            if not self.wait_until_quiet(worker):
                return
            importlib.import_module(module)
        if self.wait_until_quiet(worker):
            prefetch(self.app.profile_listings)
        if self.wait_until_quiet(worker):
            from gpuopt_tui.ui.screens.results import import_readers

            import_readers()

    def wait_until_quiet(self, worker: Worker[object]) -> bool:
        """Thread work (this module's, and any that would share the CPU with a screen being shown for the first time):
        wait while screens are being switched; False if the worker was cancelled meanwhile."""
        while self._busy() and not worker.is_cancelled:
            time.sleep(min(QUIET_S, max(0.01, self._quiet_from - time.monotonic())))
        return not worker.is_cancelled

    def worker_done(self, worker: Worker[object]) -> None:
        """Called with every worker that succeeded: the reading one starts the building."""
        if worker is self._reading:
            if enabled(WARM_UP):
                self._next_step()
            else:  # this Textual cannot build a screen unseen: each is built on its first showing
                self._finished = True

    def _next_step(self) -> None:
        self.app.set_timer(max(STEP_PAUSE_S, self._quiet_from - time.monotonic()), self._step, name="screen warm-up")

    async def stop(self) -> None:
        """Call before the app shuts down: no further step, and the screens built here and not shown handle what
        they were sent (their mounting included) first, for STOP_WAIT_S at most. The app closes its screens one mode
        after the other: a screen closed half-way through its mounting, or still handling messages once the shown
        screen is closed, would fail."""
        self._finished = True
        deadline = time.monotonic() + STOP_WAIT_S
        for name in self._built:
            while (screen := self._unshown(name)) is not None and time.monotonic() < deadline and not _settled(screen):
                await asyncio.sleep(STEP_PAUSE_S / 5)

    def _step(self) -> None:
        if self._finished or not self.app.is_running:
            return
        if self._busy():
            self._next_step()
            return
        step = next(self._steps, None)
        if step is None:
            self._finished = True
            return
        step()
        gc.freeze()
        self._next_step()

    def _unshown(self, name: str) -> AppScreen | None:
        """The screen built here, if it was not shown since (then showing it did what is left)."""
        screen = self._built.get(name)
        return screen if screen is not None and not screen.stack_updates else None

    def claim(self, name: str) -> None:
        """Put the screen built for mode `name` in its mode (if it is not yet)."""
        screen = self._built.get(name)
        if screen is not None and not mode_started(self.app, name):
            put_in_mode(self.app, name, screen)

    def build(self, name: str) -> None:
        """Create the screen of mode `name` (unless it was shown already) and start it: it composes and mounts its
        widgets in their own tasks, during the pause after this step. It joins its mode once mounted (`lay_out`),
        or when the user asks for it (`claim`)."""
        app = self.app
        if mode_started(app, name) or app.is_screen_installed(name):
            return
        if name.startswith(RESULTS_PREFIX):
            screen = app.results_opener.prepare(name.removeprefix(RESULTS_PREFIX))
        else:
            screen = next(s for s in SCREENS if s.name == name).create(app)
        start_screen(app, screen)
        self._built[name] = screen  # type: ignore[assignment]

    def lay_out(self, name: str) -> None:
        """Lay the screen out at the terminal's size, as showing it would (then showing it does not)."""
        screen = self._unshown(name)
        if screen is None:
            return
        if not screen.is_mounted:  # still mounting: this step again after a pause
            self._steps = itertools.chain([partial(self.lay_out, name)], self._steps)
            return
        if not name.startswith(RESULTS_PREFIX):  # a results screen is shown over another, in no mode of its own
            self.claim(name)
        refresh_layout(screen, self.app.size)

    def render(self, name: str) -> None:
        """Render every line of the screen into its widgets' caches; nothing is written to the terminal."""
        screen = self._unshown(name)
        if screen is not None:
            render_lines(screen)
