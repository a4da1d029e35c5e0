"""One run's results on the whole screen, in the view of its kind (the same views the kind screens show for
their latest run), for any run: opened with enter from the Runs screen or the dashboard, closed with escape.
`f` lists the run's files and opens one in $PAGER (or $EDITOR with `e`).

A finished run's screen is shown once its view's files are read and parsed in a thread (`ResultsOpener`), so that
its first frame is drawn with them: one layout and one repaint, instead of the screen, then the views mounted, then
the tables filled, each a frame of its own. The run highlighted on the Runs screen is read ahead (`prefetch`), and its
kind's screen made next by the warm-up, so that enter finds both done. A read that takes longer than PREREAD_WAIT_S
(a large run) does not
hold the screen back: the screen is shown with the read still going (the attribution view waits for it; other
views read their files themselves, as they do for a run that goes on). The reads of the
last RECENT_RUNS runs opened are kept: opening one again reads nothing while the run is unchanged.

The screen of each kind is kept (installed) once made: a later opening of a run of that kind draws into its
widgets again rather than composing, mounting and styling new ones, and the screen keeps its layout. The app's
warm-up makes each kind's screen ahead (`ResultsOpener.prepare`, ui/warmup.py), views included, laid out and
focused as when shown: the first opening after it is drawn as a later one is.
"""

from __future__ import annotations

import importlib
import os
from collections import OrderedDict
from concurrent.futures import Future
from contextlib import suppress
from functools import partial
from typing import TYPE_CHECKING, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import DataTable, Input, Static, Tabs

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.format import human_time
from gpuopt_tui.core.kinds import KINDS
from gpuopt_tui.core.runs.status import RunInfo
from gpuopt_tui.ui.external import open_file
from gpuopt_tui.ui.run_poller import RunsSnapshot
from gpuopt_tui.ui.screens.base import AppScreen
from gpuopt_tui.ui.screens.registry import SCREEN_NAMES, spec
from gpuopt_tui.ui.widgets.file_picker import FilePicker, Picked
from gpuopt_tui.ui.widgets.nav_bar import NavBar
from gpuopt_tui.ui.widgets.run_progress import RunProgress
from gpuopt_tui.ui.widgets.run_results import Preread, RunResults, run_state
from gpuopt_tui.ui.widgets.tab_switch import TabTitles

if TYPE_CHECKING:
    from textual.screen import Screen

    from gpuopt_tui.app import GpuOptApp

PREREAD_WAIT_S = 0.15  # the longest an opening waits for the run's files to be read before it shows the screen
RECENT_RUNS = 8  # runs whose reads are kept for their next opening


def results_view(kind: str) -> type[RunResults]:
    """The results view of a run kind: its kind screen's (BROWSE_RESULTS, else RESULTS), or the plain one."""
    run_kind = KINDS.get(kind)
    if run_kind is None:
        return RunResults
    screen_spec = spec(run_kind.screen)
    screen = getattr(importlib.import_module(screen_spec.module), screen_spec.factory)
    return screen.BROWSE_RESULTS or screen.RESULTS


class ResultsScreen(AppScreen):
    """The results of the run `run_id`, kept up to date while it goes on; the navigation bar shows `nav` (the
    screen it was opened from) as the current screen."""

    AUTO_FOCUS = None  # the app's: the first widget that takes the focus, so that the view's keys work at once
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Back", id="results.back", tooltip="Back to the list of runs"),
        Binding("f", "files", "Open file", id="results.files", tooltip="Open one of the run's files in $PAGER"),
        # the view's tabs switch without tabbing to them first, unless the focused widget uses the arrows itself
        # (check_action): a text field, a tab bar, a table wider than its pane
        Binding("left", "switch_tab(-1)", "Previous tab", show=False, priority=True, tooltip="The view's previous tab"),
        Binding("right", "switch_tab(1)", "Next tab", show=False, priority=True, tooltip="The view's next tab"),
    ]
    DEFAULT_CSS = """
    ResultsScreen #results-frame { height: 1fr; padding: 0 1; }
    ResultsScreen #results-head { height: auto; color: $text-muted; }
    ResultsScreen #results-progress { height: auto; max-height: 4; }
    ResultsScreen #browse-results { height: 1fr; }
    """

    def __init__(self, info: RunInfo | None, nav: str, preread: Preread | None = None, kind: str = "") -> None:
        """`info` None: a screen for runs of `kind` made ahead of their first opening (`show_run` shows one)."""
        super().__init__()
        self.info: RunInfo | None = info
        self.run_id = info.id if info is not None else ""
        self._kind = info.kind if info is not None else kind
        self._nav = nav
        self._preread = preread
        self._mounted = False  # set by on_mount: a run given before (show_run) is shown by it

    @property
    def nav_name(self) -> str:
        return self._nav

    def compose_body(self) -> ComposeResult:
        with Vertical(id="results-frame"):
            yield Static("", id="results-head")
            yield RunProgress("", gpu=self.gapp.gpu_telemetry().source, id="results-progress")
            view = results_view(self._kind)(id="browse-results")
            view.in_browser = True
            view.preread = self._preread
            view.views_ahead = self.info is None
            yield view

    @property
    def view(self) -> RunResults:
        return self.query_one("#browse-results", RunResults)

    def show_run(self, info: RunInfo, nav: str, preread: Preread | None) -> None:
        """Show another run of the same kind (before this screen, kept from an earlier opening, is shown again):
        its widgets are drawn again, none is made; the focus goes where a first opening puts it."""
        self.info, self.run_id, self._nav, self._preread = info, info.id, nav, preread
        if not self._mounted:  # made ahead and still mounting: on_mount shows the run
            return
        self.query_one(NavBar).set_active(nav)
        self.view.preread = preread
        self._show(info)
        self._focus_as_first_shown()

    def _focus_as_first_shown(self) -> None:
        """Focus the widget Textual's auto focus picks when a screen is first shown; nothing changes (and nothing is
        restyled) if it has the focus."""
        auto_focus = self.AUTO_FOCUS if self.AUTO_FOCUS is not None else self.app.AUTO_FOCUS
        self.set_focus(next((w for w in self.query(auto_focus or "*") if w.focusable), None) if auto_focus else None)

    def on_mount(self) -> None:
        self._mounted = True
        if self.run_id:  # made for a run, or made ahead and given one while it mounted
            self.query_one(NavBar).set_active(self._nav)
            self.view.preread = self._preread
            self._show(self.info)
        else:  # made ahead: focused as when shown, so that showing it restyles nothing
            self._focus_as_first_shown()

    def runs_updated(self, snapshot: RunsSnapshot) -> None:
        info = snapshot.get(self.run_id)
        if info != self.info:
            self._show(info)

    def _show(self, info: RunInfo | None) -> None:
        self.info = info
        head = self.query_one("#results-head", Static)
        if info is None:
            head.update(Content.from_markup("[$error]run $id no longer exists: escape goes back[/]", id=self.run_id))
        else:
            head.update(f"{info.kind} · {info.name} · created {human_time(info.created)} · {info.dir}")
        self.query_one("#results-progress", RunProgress).show(info)
        self.view.show(info)
        self.refresh_bindings()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "files":
            return self.info is not None
        if action == "switch_tab":
            focused = self.focused
            own_arrows = isinstance(focused, (Input, Tabs, TabTitles)) or (
                isinstance(focused, DataTable) and focused.max_scroll_x > 0
            )
            return not own_arrows
        return True

    def action_switch_tab(self, step: int) -> None:
        """Show the previous or next tab of the view's first tab bar (a view without tabs: nothing)."""
        bars = self.view.query(Tabs)
        if bars:
            tabs = bars.first(Tabs)
            if step > 0:
                tabs.action_next_tab()
            else:
                tabs.action_previous_tab()
        elif titles := self.view.query(TabTitles):
            titles.first(TabTitles).action_move(step)

    def action_close(self) -> None:
        self.dismiss()

    def action_files(self) -> None:
        if self.info is not None:
            self.app.push_screen(FilePicker(self.info.id, self.info.dir), self._picked)

    def _picked(self, picked: Picked | None) -> None:
        if picked is not None:
            open_file(self.app, picked.path, picked.role, dict(os.environ))


def import_readers() -> None:
    """Thread work: import what each kind's view reads a finished run with (the warm-up does, see ui/warmup.py)."""
    from gpuopt_tui.core.kinds import KINDS

    for kind in KINDS:
        results_view(kind).import_reader()


def screen_name(kind: str) -> str:
    """The name the results screen of a run kind is kept (installed) under."""
    return f"results-{kind}"


class ResultsOpener:
    """Opens runs' results screens for the app (see the module docstring)."""

    def __init__(self, app: GpuOptApp) -> None:
        self.app = app
        self._recent: OrderedDict[str, Preread] = OrderedDict()  # by run id, the latest opened last
        self._reads: dict[str, Future[Preread | None]] = {}  # by run id, the reads going on
        self._waiting: tuple[object, Screen[object], RunInfo, str] | None = None  # what `_show` needs, once read
        self._pending: object | None = None  # the latest opening's token: no other may be shown any more

    def open(self, info: RunInfo, nav: str) -> None:
        """Show the results of `info` over the current screen, the navigation bar showing `nav`."""
        opening = self._pending = object()
        shown_from = self.app.screen
        recent = self._fresh(info)
        if recent is not None or info.status != "finished":
            self._show(opening, shown_from, info, nav, recent)
            return
        self._waiting = (opening, shown_from, info, nav)
        in_flight = Preread(run_state(info), pending=self._read(info))  # what the screen gets if the read outlasts
        self.app.set_timer(PREREAD_WAIT_S, partial(self._show, opening, shown_from, info, nav, in_flight))

    def prefetch(self, info: RunInfo) -> None:
        """Read a finished run's results before it is opened (the run highlighted on the Runs screen), and have the
        warm-up make its kind's screen next: its opening then shows them at once."""
        self.app.warmup.prefer_results(info.kind)
        if info.status == "finished" and self._fresh(info) is None and not self._reads:
            self._read(info)

    def _fresh(self, info: RunInfo) -> Preread | None:
        """The kept read of the run, if the run has not changed since."""
        recent = self._recent.get(info.id)
        return recent if recent is not None and recent.state == run_state(info) else None

    def _read(self, info: RunInfo) -> Future[Preread | None]:
        """The read of the run's results going on (started now, unless one is)."""
        pending = self._reads.get(info.id)
        if pending is None:
            pending = self._reads[info.id] = Future()
            work = partial(self._read_in_thread, info, pending)
            self.app.run_worker(work, name="reading results", group="results-preread", thread=True, exit_on_error=False)
        return pending

    def _read_in_thread(self, info: RunInfo, pending: Future[Preread | None]) -> None:
        """Thread work: read what the view of the run's kind shows; then keep it, and show a waiting opening with it
        (or, shown already, hand it to the view waiting for it through `pending`)."""
        preread: Preread | None = None
        try:
            preread = Preread(run_state(info), results_view(info.kind).read_finished(info))
        except UserError as error:
            preread = Preread(run_state(info), error=error)
        except Exception:  # the view's own read meets it again and reports it as every failed read is reported
            preread = None
        finally:
            pending.set_result(preread)
        with suppress(RuntimeError):  # raised when the app closed meanwhile: there is nothing to show it on
            self.app.call_from_thread(self._read_done, info, preread)

    def _read_done(self, info: RunInfo, preread: Preread | None) -> None:
        self._reads.pop(info.id, None)
        if preread is not None:
            self._recent[info.id] = preread
            self._recent.move_to_end(info.id)
            while len(self._recent) > RECENT_RUNS:
                self._recent.popitem(last=False)
        waiting, self._waiting = self._waiting, None
        if waiting is not None and waiting[2].id == info.id:
            self._show(*waiting, preread)

    def _show(
        self, opening: object, shown_from: Screen[object], info: RunInfo, nav: str, preread: Preread | None
    ) -> None:
        if opening is not self._pending:
            return  # shown already (its read took longer than the wait), or another opening came since
        self._pending = None
        if self.app.screen is not shown_from:
            return  # the user went elsewhere meanwhile
        name = screen_name(info.kind)
        kept = self.app.get_screen(name) if self.app.is_screen_installed(name) else None
        if isinstance(kept, ResultsScreen) and not self._stacked(kept):
            kept.show_run(info, nav, preread)
            self.app.push_screen(kept)
            return
        screen = ResultsScreen(info, nav, preread)
        if kept is None:
            self.app.install_screen(screen, name)
        self.app.push_screen(screen)

    def prepare(self, kind: str) -> ResultsScreen:
        """The results screen of `kind`, made (and kept) ahead of its first opening; the caller starts it."""
        screen = ResultsScreen(None, "runs", kind=kind)
        self.app.install_screen(screen, screen_name(kind))
        return screen

    def _stacked(self, screen: ResultsScreen) -> bool:
        """Whether `screen` is still in a screen stack (left open under another screen's mode)."""
        for mode in SCREEN_NAMES:
            try:
                if screen in self.app.get_screen_stack(mode):
                    return True
            except KeyError:  # a mode not shown yet has no stack
                continue
        return False
