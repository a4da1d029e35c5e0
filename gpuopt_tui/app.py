"""The Textual application: screens, keys, the command palette, run polling and error reporting.

`make_app()` builds it for the CLI and for tests. Nothing here (or under gpuopt_tui/ui) imports torch: the
first frame comes in a fraction of a second, and runs are separate processes that outlive the app. The profile
modules are not needed for the first frame: they are imported on first use, or by the warm-up after it
(ui/warmup.py); tomlkit only when a profile is written.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from textual.app import App
from textual.binding import Binding, BindingType
from textual.screen import ModalScreen
from textual.worker import Worker, WorkerState

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.format import safe_text, with_article
from gpuopt_tui.core.paths import runs_dir
from gpuopt_tui.core.runs.lifecycle import active_run_pids, cancel_run, handed_to_warm_runner, start_run
from gpuopt_tui.core.runs.proc_files import seconds_running
from gpuopt_tui.core.runs.status import RunInfo
from gpuopt_tui.core.telemetry.backend import NoGpuSource
from gpuopt_tui.ui import textual_internals
from gpuopt_tui.ui.gpu_telemetry import GpuTelemetry
from gpuopt_tui.ui.palette import Command, CommandList
from gpuopt_tui.ui.run_poller import RunPoller, RunsPolled, RunsSnapshot
from gpuopt_tui.ui.screens.base import AppScreen
from gpuopt_tui.ui.screens.registry import SCREEN_NAMES, SCREENS
from gpuopt_tui.ui.textual_internals import BeforeShutdown
from gpuopt_tui.ui.warmup import ScreenWarmup
from gpuopt_tui.ui.widgets.confirm import ConfirmDialog
from gpuopt_tui.ui.widgets.gpu_panel import GpuPanel

if TYPE_CHECKING:
    from gpuopt_tui.core.profiles.common import ProfileBase
    from gpuopt_tui.ui.profile_listing import ProfileListing
    from gpuopt_tui.ui.screens.results import ResultsOpener
    from gpuopt_tui.ui.widgets.gpu_view import GpuView

_IMPORTED_AT = time.perf_counter()
logger = logging.getLogger(__name__)
ERROR_REPEAT_S = 30.0  # the same error is not notified again within this time


def continuing_runs_note(active: list[RunInfo]) -> str:
    """What quitting means for runs going on: they go on, and how to follow them again."""
    listed = ", ".join(r.id for r in active[:3]) + (f" and {len(active) - 3} more" if len(active) > 3 else "")
    runs = "1 run is" if len(active) == 1 else f"{len(active)} runs are"
    return (
        f"{runs} still going ({listed}): they go on after you quit. Follow one again with "
        f"`gpuopt-tui attach {active[0].id}`, or start gpuopt-tui again to see them all."
    )


def unsaved_question(unsaved: list[str]) -> str:
    """The question asked on quitting with unsaved profile edits: what would be lost, and how to keep it."""
    return (
        f"Quit and lose {' and '.join(unsaved)}? Stay (n), then save with ctrl+s on the profile's screen, to keep them."
    )


class GpuOptCommands(CommandList):
    """Command palette: go to a screen, or start a run of any profile."""

    def commands(self) -> Iterator[Command]:
        from gpuopt_tui.core.kinds import engine_available
        from gpuopt_tui.core.profiles.io import list_profiles

        app: GpuOptApp = self.app  # type: ignore[assignment]
        for screen in SCREENS:
            yield f"Go to {screen.label}", partial(app.action_show, screen.name), screen.help
        yield (
            "Keep a warm runner",
            app.keep_warm_runner,
            "a process with torch, transformers and the engines imported, so that runs started here skip those "
            "seconds; it ends when the app does (gpuopt-tui --warm starts with one)",
        )
        for entry in list_profiles():
            name = f"Run profile {safe_text(entry.name)}"
            if entry.error:  # listed, so that a profile the user expects to see is not silently missing
                report = partial(app.report_error, entry.error, title=f"Profile {entry.name} is broken")
                yield f"{name} (broken)", report, safe_text(entry.error)
            elif engine_available(entry.kind):
                description = f": {safe_text(entry.description)}" if entry.description else ""
                run = partial(app.run_profile_file, entry.path)
                yield name, run, f"start {with_article(entry.kind)} run{description}"


class GpuOptApp(BeforeShutdown[int]):
    TITLE = "gpuopt-tui"
    CSS_PATH = "app.tcss"
    COMMANDS = App.COMMANDS | {GpuOptCommands}
    BINDINGS: ClassVar[list[BindingType]] = [
        *(Binding(s.key, f"show('{s.name}')", s.label, show=False, id=f"screen.{s.name}") for s in SCREENS),
        Binding("q", "quit", "Quit", id="app.quit", tooltip="Quit (runs keep going)"),
    ]

    def __init__(
        self,
        replay: Path | None = None,
        readonly: bool = False,
        screen: str = "dashboard",
        telemetry: GpuTelemetry | None = None,
        warm: bool = False,
    ) -> None:
        """`telemetry`: a GPU source and history to show instead of live NVML or `replay` (tests, screenshots);
        `warm`: keep a warm runner while the app is open (core/runs/warm.py)."""
        self.DEFAULT_MODE = screen  # the first screen is built directly, with no blank screen before it
        super().__init__()
        for spec in SCREENS:
            self.add_mode(spec.name, partial(spec.create, self))
        self.replay = replay
        self.readonly = readonly
        self.warm = warm
        self.poller = RunPoller(self, runs_dir())
        self.runs = RunsSnapshot(self.poller.root)
        self.startup_seconds: float | None = None
        self._previous_screen = "dashboard"
        self._recent_errors: dict[str, float] = {}
        self._quit_dialog: ConfirmDialog | None = None  # the question asked on quitting with runs going on
        self._telemetry = telemetry
        self.profile_listings: dict[str, ProfileListing] = {}  # by kind, read after the first frame (kind screens)
        self.warmup = ScreenWarmup(self)  # the screens not shown yet, made ready after the first frame
        self._results: ResultsOpener | None = None  # see results_opener
        if "TEXTUAL_ANIMATIONS" not in os.environ:
            self.animation_level = "none"  # over SSH every animation frame is bytes on the wire

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def on_mount(self) -> None:
        textual_internals.check(self)  # before the warm-up and any screen made after the first frame
        self.poller.poll_now()

    def on_ready(self) -> None:
        age = seconds_running()
        self.startup_seconds = age if age is not None else time.perf_counter() - _IMPORTED_AT
        logger.info("first frame %.3f s after the process started", self.startup_seconds)
        self.log.info(f"first frame {self.startup_seconds:.3f} s after the process started")
        self.warmup.start()
        if self.warm:  # after the screens' warm-up: on a 2-core machine its imports would slow the first keys
            from gpuopt_tui.core.runs.warm import WARM_START_DELAY_S

            self._start_warm_runner(WARM_START_DELAY_S)

    def keep_warm_runner(self) -> None:
        """The command palette's "Keep a warm runner": one from now on, ending with the app (--warm starts with one)."""
        if self.warm:
            self.notify("a warm runner is kept already (the Runs screen says when it is ready)", title="Warm runner")
            return
        self._start_warm_runner(0.0)

    def _start_warm_runner(self, delay: float) -> None:
        from gpuopt_tui.core.runs.warm import start_warm_runner

        try:
            pid = start_warm_runner(owner=os.getpid(), minutes=0, replace=True, delay=delay)
        except OSError as e:
            self.report_error(f"cannot start a warm runner ({e.strerror or e})", title="Warm runner")
            return
        self.warm = True
        self.notify(
            f"warm runner {pid}: imports torch, transformers and the engines in the background; runs started here "
            "then skip those seconds (it ends when the app does)",
            title="Warm runner",
        )

    async def before_shutdown(self) -> None:
        await self.warmup.stop()  # screens built in the background finish mounting before they are closed

    def on_unmount(self) -> None:
        if self._telemetry is not None:
            self._telemetry.close()
        if self.warm:
            from gpuopt_tui.core.runs.warm import stop_warm_runners

            stop_warm_runners(owner=os.getpid())

    # -- screens ------------------------------------------------------------------------------------------------

    def action_show(self, name: str) -> None:
        if name == "help" and self.current_mode == "help":
            name = self._previous_screen  # the help key toggles
        if name != self.current_mode:
            self.warmup.switching_to(name)
            self._previous_screen = self.current_mode
            self.switch_mode(name)

    def action_back(self) -> None:
        self.action_show(self._previous_screen)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # while a dialog is open, answer it first
        return not (action == "show" and isinstance(self.screen, ModalScreen))

    def _show_on(self, name: str, method: str, *args: object) -> None:
        """Switch to a screen and call one of its methods once it is shown (`select_run`, `select_gpu`)."""
        self.action_show(name)
        call = getattr(self.screen, method, None)
        if callable(call):
            self.call_after_refresh(call, *args)

    def show_run(self, run_id: str) -> None:
        """Open the runs screen on one run."""
        self._show_on("runs", "select_run", run_id)

    def open_results(self, run_id: str) -> None:
        """Show one run's results in its kind's view, over the current screen (escape comes back)."""
        info = self.runs.get(run_id)
        if info is None:
            self.report_error(f"run {run_id} is no longer listed", title="No results")
            return
        self.warmup.hold()
        self.results_opener.open(info, self.current_mode)

    @property
    def results_opener(self) -> ResultsOpener:
        """Opens runs' results screens, and makes them ahead for the warm-up; made on first use."""
        if self._results is None:
            from gpuopt_tui.ui.screens.results import ResultsOpener  # its kind views are imported on first use

            self._results = ResultsOpener(self)
        return self._results

    def on_gpu_view_run_requested(self, message: GpuView.RunRequested) -> None:
        self.show_run(message.run_id)

    def on_gpu_panel_selected(self, message: GpuPanel.Selected) -> None:
        self._show_on("gpu", "select_gpu", message.index)

    def gpu_telemetry(self) -> GpuTelemetry:
        """The telemetry source and history shared by the GPU panel and the GPU screen, opened on first use."""
        if self._telemetry is None:
            try:
                self._telemetry = GpuTelemetry.open(self.replay, self.active_run_pids)
            except UserError as error:  # an unreadable trace: the GPU views say why, everything else works
                self.report_error(str(error), title="GPU trace not shown")
                self._telemetry = GpuTelemetry(NoGpuSource(f"trace not shown: {error}"))
        return self._telemetry

    def active_run_pids(self) -> dict[int, str]:
        """Process id -> run id of the runs going on (the GPU panel marks their processes)."""
        return active_run_pids(self.runs.runs)

    # -- runs ---------------------------------------------------------------------------------------------------

    def on_runs_polled(self, message: RunsPolled) -> None:
        self.poller.handled(message)
        snapshot = message.snapshot
        if snapshot is None or not message.changed:
            return
        if snapshot.error and snapshot.error != self.runs.error:
            self.report_error(snapshot.error, title="Runs")
        self.runs = snapshot
        for screen in reversed(self.screen_stack):  # the screen under an open dialog keeps updating
            if isinstance(screen, AppScreen):
                screen.runs_updated(snapshot)
                break

    def start_profile_run(self, profile: ProfileBase, source: Path | None) -> Path:
        """Start a run in the background (UserError when it cannot start) and watch for it at once."""
        run_dir = start_run(profile, source=source)
        warm = " (handed to the warm runner)" if handed_to_warm_runner(run_dir) else ""
        self.notify(f"started {run_dir.name}{warm}", title=f"{profile.kind}: {profile.name}")
        self.poller.poll_now()
        return run_dir

    def run_profile_file(self, path: Path) -> None:
        """Start a run of a profile file (from the command palette) and show its screen."""
        from gpuopt_tui.core.kinds import KINDS
        from gpuopt_tui.core.profiles.io import load_profile

        try:
            profile = load_profile(path)
            self.start_profile_run(profile, path)
        except UserError as e:
            self.report_error(str(e), title="Run not started")
            return
        self.action_show(KINDS[profile.kind].screen)

    def confirm_cancel(self, info: RunInfo) -> None:
        """Ask, then send the run's process group SIGTERM; it stops after its current chunk."""

        def answered(yes: bool | None) -> None:
            if not yes:
                return
            try:
                cancel_run(info.dir)
            except UserError as e:
                self.report_error(str(e), title="Not cancelled")
                return
            self.notify(f"cancelling {info.id}: it stops after the current chunk")
            self.poller.poll_now()

        self.push_screen(
            ConfirmDialog(f"Cancel run {info.id} ({info.kind}: {info.name})?", "Cancel run", "Keep"), answered
        )

    async def action_quit(self) -> None:
        """Quit; with unsaved profile edits, ask first (they would be lost); with runs going on, say first that
        they go on and how to come back to them."""
        active = [r for r in self.runs.runs if r.active]
        unsaved = self.unsaved_edits()
        if not active and not unsaved:
            self.exit()
            return
        note = continuing_runs_note(active) if active else None
        if self.screen is self._quit_dialog:  # quit again while asked: yes about runs; edits need the answer
            if not unsaved:
                self.exit(message=note)
            return
        question = " ".join(([unsaved_question(unsaved)] if unsaved else []) + ([note] if note else []))

        def answered(yes: bool | None) -> None:
            self._quit_dialog = None
            if yes:
                self.exit(message=note)

        self._quit_dialog = ConfirmDialog(question, "Quit, discard edits" if unsaved else "Quit", "Stay")
        self.push_screen(self._quit_dialog, answered)

    def unsaved_edits(self) -> list[str]:
        """What quitting would lose, of every screen built so far."""
        lost = []
        for spec in SCREENS:
            try:
                stack = self.get_screen_stack(spec.name)
            except KeyError:  # not built yet
                continue
            lost += [edits for screen in stack if isinstance(screen, AppScreen) and (edits := screen.unsaved_edits())]
        return lost

    # -- errors -------------------------------------------------------------------------------------------------

    def report_error(self, message: str, title: str = "Error") -> None:
        """Show an error the user can act on; the same one is not repeated within ERROR_REPEAT_S."""
        now = time.monotonic()
        if now - self._recent_errors.get(message, -ERROR_REPEAT_S) < ERROR_REPEAT_S:
            return
        self._recent_errors[message] = now
        self.notify(safe_text(message), title=safe_text(title), severity="error", timeout=10, markup=False)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """Every worker runs with exit_on_error=False and ends here when it fails."""
        if event.state is WorkerState.SUCCESS:
            self.warmup.worker_done(event.worker)
        if event.state is not WorkerState.ERROR:
            return
        error = event.worker.error
        if isinstance(error, UserError):
            self.report_error(str(error), title=event.worker.name or "Error")
            return
        logger.error("worker %r failed", event.worker.name, exc_info=error)
        self.report_error(f"{type(error).__name__}: {error}", title=f"{event.worker.name or 'background task'} failed")


def make_app(
    replay: Path | None = None,
    readonly: bool = False,
    screen: str | None = None,
    telemetry: GpuTelemetry | None = None,
    warm: bool = False,
) -> GpuOptApp:
    """The app as the CLI runs it; raises UserError for a bad screen name or a missing trace file.
    `telemetry` replaces the GPU source (see GpuOptApp)."""
    screen = screen or "dashboard"
    if screen not in SCREEN_NAMES:
        raise UserError(f"unknown screen {screen!r}; expected one of: {', '.join(SCREEN_NAMES)}")
    if replay is not None and not Path(replay).is_file():
        raise UserError(f"{replay}: no such trace file (record one with `gpuopt-tui gpu --record FILE`)")
    return GpuOptApp(replay=replay, readonly=readonly, screen=screen, telemetry=telemetry, warm=warm)
