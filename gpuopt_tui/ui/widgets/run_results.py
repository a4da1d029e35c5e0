"""What a run produced: its summary (from the `finished` event or results/summary.json) and its result files.

Kind screens may use a subclass that draws richer views of the same files; this base shows only what the run
wrote, never anything computed here. A subclass's views (tabs, tables) are mounted the first time there is
something to show in them: a screen whose run has no results yet builds only the summary text.

A finished run's files can be read before the view is made (`read_finished`, in a thread: see
ui/screens/results.py): the view is then composed with its views and draws what was read at once, in the frame
that shows it, instead of reading in a worker and mounting its views a few frames later. A read that outlasts
the opening's wait is handed to the view still going (`Preread.pending`): a view whose read is long (a large run's
samples) waits for it (`wait_or_read`) rather than reading the same files again beside it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.content import Content
from textual.widget import Widget
from textual.widgets import Static, TabbedContent, TabPane, Tabs

from gpuopt_tui.core.format import human_bytes
from gpuopt_tui.core.runs.files import is_partial_write
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.status import RunInfo
from gpuopt_tui.ui.loading import Loaded
from gpuopt_tui.ui.textual_internals import place_underline
from gpuopt_tui.ui.widgets.log_view import LogView

MAX_FILES = 40
MAX_LIST_ITEMS = 6


def read_summary(info: RunInfo) -> dict[str, Any]:
    """The summary of a finished run: the `finished` event's, else results/summary.json if the run wrote one."""
    if info.summary:
        return info.summary
    try:
        data = json.loads(RunDir(info.dir).summary.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def result_files(run_dir: Path) -> list[tuple[str, int]]:
    """Files under results/ (relative path, size), at most MAX_FILES."""
    root = RunDir(run_dir).results
    found: list[tuple[str, int]] = []
    try:
        for path in sorted(root.rglob("*")):
            if path.is_file() and not is_partial_write(path):
                found.append((str(path.relative_to(root)), path.stat().st_size))
                if len(found) >= MAX_FILES:
                    break
    except OSError:
        pass
    return found


def summary_lines(summary: dict[str, Any], prefix: str = "") -> list[str]:
    lines: list[str] = []
    for key, value in summary.items():
        if isinstance(value, dict):
            lines.extend(summary_lines(value, f"{prefix}{key}."))
        else:
            lines.append(f"{prefix}{key}: {_scalar(value)}")
    return lines


def _scalar(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        shown = ", ".join(_scalar(v) for v in value[:MAX_LIST_ITEMS])
        more = f", … ({len(value)} items)" if len(value) > MAX_LIST_ITEMS else ""
        return f"[{shown}{more}]"
    return str(value)


def run_state(info: RunInfo | None) -> object:
    """What a view's drawing of a run depends on: its id, status, end time and number of result files."""
    return (info.id, info.status, info.ended, info.artifacts) if info else None


@dataclass(frozen=True)
class Preread:
    """What a view's `read_finished` returned for a run in the state `state` (or the UserError it raised); or,
    `pending`, that read still going: its Preread once it ends (None: it failed unexpectedly)."""

    state: object
    value: Any = None
    error: Exception | None = None
    pending: Future[Preread | None] | None = None


PENDING_POLL_S = 0.05  # how often a view waiting for a read in flight looks whether its own worker was cancelled


def wait_or_read(pending: Future[Preread | None] | None, read: Callable[[], Any], cancelled: Callable[[], bool]) -> Any:
    """Thread work: the value of the read in flight `pending` (see RunResults.take_pending) once it ends, or
    `read()` where there is none or it failed unexpectedly; None once `cancelled()` (nothing is posted then)."""
    while pending is not None and not cancelled():
        try:
            preread = pending.result(timeout=PENDING_POLL_S)
        except FutureTimeout:
            continue
        if preread is None:
            break
        if preread.error is not None:
            raise preread.error
        return preread.value
    return None if cancelled() else read()


class ResultTabs(TabbedContent):
    """A TabbedContent that places its tab underline again once its active tab has been laid out.

    Tabs place the underline after a refresh; when the views are mounted on a busy machine, that refresh can come
    before the tabs are laid out, and the underline stays a dot under the first tab until the next resize.
    """

    PLACE_TRIES = 20  # refreshes to wait for the layout (a hidden view never gets one)

    def on_mount(self) -> None:
        self.call_after_refresh(self._place_underline, self.PLACE_TRIES)

    def _place_underline(self, tries: int) -> None:
        tabs = self.query_one(Tabs)
        tab = tabs.active_tab
        if tab is None:
            return
        if tab.size.width == 0:
            if tries > 1:
                self.call_after_refresh(self._place_underline, tries - 1)
            return
        place_underline(tabs)  # what Tabs do on a resize: placed after the next refresh


def tabbed(*panes: TabPane, id: str) -> TabbedContent:
    """A TabbedContent of `panes`, made outside a compose method (views are mounted when first needed)."""
    tabs = ResultTabs(id=id)
    for pane in panes:
        tabs.compose_add_child(pane)  # what composing it with `with` does
    return tabs


class RunResults(VerticalScroll):
    """Summary and result files of a run; for a failed run, the tail of its log.

    The kind screen maximizes it with ctrl+o (`-maximized` then); subclasses override `run_changed` to read
    the run's files again, `has_results` and `focus_first`, and `compose_views` for views mounted on demand
    (`with_views`).
    """

    ALLOW_MAXIMIZE = True
    VIEWS_FIRST: ClassVar[bool] = False  # the views go above the summary text (else below it)
    in_browser = False  # shown by the results browser, where no profile form is at hand to start a run from

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, classes="run-results")
        self._key: object = object()  # what is shown: run_state(the run)
        self._views: Literal["none", "mounting", "ready"] = "none"
        self.preread: Preread | None = None  # set before the view is mounted; used once, by the first draw
        self._pending: Future[Preread | None] | None = None  # that read, still going when the view was shown
        self.views_ahead = False  # set before the view is mounted: its views are made with it, before any run

    @classmethod
    def read_finished(cls, info: RunInfo) -> Any:
        """Thread work: what the view reads to show the finished run `info` (what its own read would give it);
        None where it reads nothing ahead. Raises what that read raises."""
        return None

    @classmethod
    def import_reader(cls) -> None:
        """Thread work: import the modules `read_finished` needs, where it imports them when first called."""

    @classmethod
    def views_for(cls, value: Any) -> bool:
        """Whether `value` (from `read_finished`) is drawn in the views: then they are composed with the view."""
        return False

    def take_preread(self, info: RunInfo, reply_type: type[Loaded], key: Any) -> Any:
        """The read made before the view was shown, as the `reply_type` message (for `key`) its own read would
        post (see loading.reply), if it was made for `info` in its present state; once (a later change of the run
        is read again). None otherwise."""
        preread, self.preread, self._pending = self.preread, None, None
        if preread is None or preread.state != run_state(info):
            return None
        if preread.pending is not None:  # still going: the view's own read may wait for it (take_pending)
            self._pending = preread.pending
            return None
        return reply_type(key, preread.value, preread.error)

    def take_pending(self) -> Future[Preread | None] | None:
        """The read made before the view was shown, where `take_preread` found it still going; once."""
        pending, self._pending = self._pending, None
        return pending

    @property
    def views_composed(self) -> bool:
        """Whether the views are made with the view (`views_ahead`, or a read made ahead has something for them)."""
        preread = self.preread
        return self.views_ahead or (preread is not None and self.views_for(preread.value))

    def compose(self) -> ComposeResult:
        views = self.compose_views() if self.views_composed else []
        if views:
            self._views = "ready"  # composed here: mounted with the view, before its first draw
        if self.VIEWS_FIRST:
            yield from views
        yield Static("", id="results-text", markup=False)  # the log of a failed run is mounted after it when needed
        if not self.VIEWS_FIRST:
            yield from views

    def on_mount(self) -> None:
        if self.views_ready:
            self.views_mounted()

    def compose_views(self) -> list[Widget]:
        """The widgets that show a run's results beyond the summary text (none here), made when first needed."""
        return []

    @property
    def views_ready(self) -> bool:
        """Whether the views are mounted: what draws into them does nothing before (`with_views` draws then)."""
        return self._views == "ready"

    def with_views(self, draw: Callable[[], object]) -> None:
        """Call `draw` once the views are mounted: at once if they are, else after mounting them."""
        if self.views_ready:
            draw()
        else:
            self.call_later(self._mount_views, draw)

    async def _mount_views(self, draw: Callable[[], object]) -> None:
        # callbacks run one at a time, in order: a second one finds the views mounted by the first
        if self._views == "none":
            self._views = "mounting"
            text = self.query_one("#results-text")
            views = self.compose_views()
            await (self.mount_all(views, before=text) if self.VIEWS_FIRST else self.mount_all(views))
            self._views = "ready"
            self.views_mounted()
        draw()

    def views_mounted(self) -> None:
        """Called once, when the views were mounted."""

    def show(self, info: RunInfo | None) -> None:
        """Called with the latest run on each poll; `run_changed` only when its state moved on."""
        key = run_state(info)
        if key == self._key:
            return
        self._key = key
        self.run_changed(info)

    def run_changed(self, info: RunInfo | None) -> None:
        """The run shown changed, or its status, end time or result files did: draw the summary (and the log of
        a failed run) again."""
        failed = info is not None and info.status in ("failed", "crashed")
        log = next(self.query("#results-log").results(LogView), None)
        if log is None and failed:
            log = LogView(lines=40, id="results-log")
            self.mount(log, after="#results-text")
        if log is not None:
            log.display = failed
            log.show(info.dir if failed and info else None)
        self.query_one("#results-text", Static).update(self.describe(info))

    @property
    def showing_log(self) -> bool:
        """Whether the tail of a failed run's log is shown."""
        return any(log.display for log in self.query("#results-log"))

    @property
    def has_results(self) -> bool:
        """Whether there is anything to show on the whole screen."""
        return self._key is not None

    def focus_first(self) -> None:
        """Focus the first thing inside that takes the focus, other than a tab bar (when maximized): the view
        shown rather than the choice of view, which shift+tab reaches."""
        inside = [w for w in self.screen.focus_chain if self in w.ancestors]
        views = [w for w in inside if not isinstance(w, Tabs)]
        target = (views or inside or [self])[0]
        if target.focusable:
            target.focus()

    def describe(self, info: RunInfo | None) -> Content:
        if info is None:
            return Content("")
        if info.active:
            return Content("Results appear here when the run finishes.")
        parts: list[Content] = []
        if info.status in ("failed", "crashed"):
            return Content.from_markup("[b]End of $log[/] (the message is above)", log=RunDir.LOG)
        summary = read_summary(info)
        if summary:
            parts.append(Content.from_markup("[b]Summary[/]"))
            parts.extend(Content("  " + line) for line in summary_lines(summary))
        files = result_files(info.dir)
        parts.append(Content.from_markup("[b]Result files[/]  $dir", dir=str(RunDir(info.dir).results)))
        if files:
            parts.extend(Content(f"  {name}  {human_bytes(size)}") for name, size in files)
        else:
            parts.append(Content("  (none)"))
        return Content("\n").join(parts)
