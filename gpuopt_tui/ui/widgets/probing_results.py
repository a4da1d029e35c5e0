"""The results view of probing runs: a head line, then the probes as a table and a plot of accuracy against layer
(filled in live from the run's events while it goes), and the feature cache. The Layer ablation screen shows it for
its latest run, the results browser for any run."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.content import Content
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import Button, ContentSwitcher, Static, Tab, Tabs

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.ablation import AblationProfile, split_representation
from gpuopt_tui.core.profiles.io import load_profile
from gpuopt_tui.core.results.ablation import (
    FEATURE_METRIC,
    PROBE_METRIC,
    SPLITS,
    AblationResults,
    ReportedProbe,
    ReportedProbes,
    ResultRow,
    load_results,
    series_of,
)
from gpuopt_tui.core.runs.events import EventTail
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.status import RunInfo
from gpuopt_tui.ui.loading import Loaded, reply
from gpuopt_tui.ui.widgets.ablation_view import AccuracyPlot, CachePanel, PlotData, ProbeTable
from gpuopt_tui.ui.widgets.run_results import RunResults

VIEWS = ("table", "plot", "cache")
LIVE_INTERVAL_S = 1.0  # events of a running run are read at most this often, only while the screen is shown
WANTED_METRICS = frozenset({PROBE_METRIC, FEATURE_METRIC})
ALL_LAYERS_VARIANT = "_all_layers"


def probe_events(tail: EventTail) -> list[dict[str, Any]]:
    """New events that tell of finished probes, features or the number of probes."""
    return [
        e
        for e in tail.read()
        if (e["type"] == "metric" and e.get("name") in WANTED_METRICS)
        or (e["type"] == "progress" and e.get("unit") == "probes")
    ]


def representation_order(run_dir: Path) -> list[str]:
    """The representations a run probes, as its frozen profile lists them ([] if it cannot be read)."""
    try:
        profile = load_profile(RunDir(run_dir).profile)
    except UserError:
        return []
    return list(profile.ablation.representations) if isinstance(profile, AblationProfile) else []


class ReportedState:
    """A run's probes as its events tell them, for runs without results.json (yet): the reader of its events
    file, what has been read so far, and the run's representations in the order its profile lists them (so that
    rows and series keep their places and colours as probes arrive)."""

    def __init__(self, info: RunInfo) -> None:
        self.run_dir = info.dir
        self.tail = EventTail(RunDir(info.dir).events)
        self.probes = ReportedProbes()
        self.order: list[str] | None = None

    def read(self) -> list[dict[str, Any]]:
        """New events (in a thread; one read at a time)."""
        if self.order is None:
            self.order = representation_order(self.run_dir)
        return probe_events(self.tail)

    def rows(self) -> list[ReportedProbe]:
        rank = {name: i for i, name in enumerate(self.order or [])}
        return sorted(self.probes.rows, key=lambda r: rank.get(r.representation, len(rank)))


class EventsRead(Loaded):
    """The probes a running (or stopped) run has reported since the last read."""


class ResultsRead(Loaded):
    """A finished run's results."""


class ProbingResults(RunResults):
    """The latest probing run: a head line, then the views Table, Plot and Cache (tabs, or `v`)."""

    VIEWS_FIRST = True

    DEFAULT_CSS = """
    ProbingResults {
        overflow-y: auto;
    }
    ProbingResults.-maximized {
        width: 1fr;
        height: 1fr;
        padding: 0 1;
    }
    ProbingResults #ablation-head {
        height: auto;
        max-height: 3;
    }
    ProbingResults #ablation-show-cache {
        width: auto;
    }
    ProbingResults #ablation-bar {
        height: 1;
    }
    ProbingResults #ablation-bar Tabs {
        width: 1fr;
        height: 1;
    }
    ProbingResults #ablation-bar #ablation-split {
        width: 18;  /* its three tabs */
    }
    ProbingResults #ablation-bar Underline {
        display: none;
    }
    ProbingResults #ablation-bar Tab.-active {
        text-style: bold reverse;
    }
    ProbingResults #ablation-views {
        height: 1fr;
        min-height: 6;
    }
    ProbingResults #ablation-views > ProbeTable {  /* the plot and the cache panel take 1fr themselves */
        height: 1fr;
    }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("v", "next_view", "View", id="ablation.view", tooltip="Show the table, the plot or the cache"),
        Binding("s", "next_split", "Split", id="ablation.split", tooltip="Accuracy of the test, val or train split"),
        Binding("o", "next_sort", "Sort", id="ablation.sort", tooltip="Sort the table by the next column"),
        Binding("c", "clear_cache", "Clear cache", id="ablation.clear_cache", tooltip="Delete every cached feature"),
    ]

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.split = "test"
        self.info: RunInfo | None = None
        self.results: AblationResults | None = None
        self.problem = ""  # why a finished run's results cannot be shown
        self._reported: ReportedState | None = None
        self._reading: ReportedState | None = None  # whose events a worker is reading now
        self._timer: Timer | None = None

    def compose(self) -> ComposeResult:
        yield Static("", id="ablation-head")
        yield Button("Show the feature cache", id="ablation-show-cache", compact=True)  # until the views are mounted
        yield from super().compose()

    @classmethod
    def read_finished(cls, info: RunInfo) -> AblationResults:
        return load_results(info.dir)

    @classmethod
    def views_for(cls, value: Any) -> bool:
        return True  # shown for any run

    def compose_views(self) -> list[Widget]:
        """The view and split tabs and the views: mounted once a run is shown, or the cache is asked for."""
        return [
            Horizontal(
                Tabs(*(Tab(view.capitalize(), id=f"view-{view}") for view in VIEWS), id="ablation-tabs"),
                Tabs(*(Tab(split, id=f"split-{split}") for split in SPLITS), id="ablation-split"),
                id="ablation-bar",
            ),
            ContentSwitcher(
                ProbeTable(id="table"),
                AccuracyPlot(id="plot"),
                CachePanel(id="cache"),
                initial="table",
                id="ablation-views",
            ),
        ]

    def views_mounted(self) -> None:
        self.query_one("#ablation-show-cache").display = False  # the Cache tab shows it now

    def on_mount(self) -> None:
        self._timer = self.set_interval(LIVE_INTERVAL_S, self._tick, pause=True, name="ablation live events")
        self._redraw()

    # -- views ------------------------------------------------------------------------------------------------

    @property
    def view(self) -> str:
        """The view shown ("" before the views are mounted)."""
        if not self.views_ready:
            return ""
        return self.query_one("#ablation-views", ContentSwitcher).current or "table"

    def show_view(self, view: str) -> None:
        self.with_views(lambda: setattr(self.query_one("#ablation-tabs", Tabs), "active", f"view-{view}"))

    @on(Button.Pressed, "#ablation-show-cache")
    def _show_cache(self) -> None:
        self.show_view("cache")
        self.with_views(self.focus_first)

    @on(Tabs.TabActivated, "#ablation-tabs")
    def _view_chosen(self, event: Tabs.TabActivated) -> None:
        event.stop()
        view = str(event.tab.id).removeprefix("view-")
        self.query_one("#ablation-views", ContentSwitcher).current = view
        if view == "cache":
            self.query_one(CachePanel).reload()
        self.refresh_bindings()

    def focus_first(self) -> None:
        """The view tabs: they stay in sight whichever view is shown, so v, s, o and c keep working."""
        if self.views_ready:
            self.query_one("#ablation-tabs").focus()
        else:
            self.query_one("#ablation-show-cache").focus()

    def action_next_view(self) -> None:
        self.show_view(VIEWS[(VIEWS.index(self.view) + 1) % len(VIEWS)])

    def action_next_split(self) -> None:
        self.query_one("#ablation-split", Tabs).active = f"split-{SPLITS[(SPLITS.index(self.split) + 1) % len(SPLITS)]}"

    @on(Tabs.TabActivated, "#ablation-split")
    def _split_chosen(self, event: Tabs.TabActivated) -> None:
        event.stop()
        split = str(event.tab.id).removeprefix("split-")
        if split != self.split:
            self.split = split
            self._redraw()

    def action_next_sort(self) -> None:
        self.query_one(ProbeTable).next_sort()

    def action_clear_cache(self) -> None:
        self.show_view("cache")
        self.with_views(lambda: self.query_one(CachePanel).action_clear())

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("next_view", "next_split", "next_sort", "clear_cache") and not self.views_ready:
            return False
        if action == "next_sort":
            return self.view == "table"
        if action == "next_split":
            return self.view != "cache"
        if action == "clear_cache":
            return self.view == "cache"
        return True

    # -- following the latest run -----------------------------------------------------------------------------

    def show(self, info: RunInfo | None) -> None:
        if info is not None and info.active and self._timer is not None:
            self._timer.resume()  # also after the screen was shown again
        super().show(info)

    def run_changed(self, info: RunInfo | None) -> None:
        super().run_changed(info)
        if info is None or self.info is None or info.id != self.info.id:
            self.results, self.problem = None, ""
            self._reported = ReportedState(info) if info is not None else None
        self.info = info
        self._redraw()
        if info is None:
            return
        if info.status == "finished":
            self._pause_live()
            if (preread := self.take_preread(info, ResultsRead, info.dir)) is not None:
                self._results_read(preread)
            else:
                self._read_results(info.dir)
            if self.view == "cache":
                self.query_one(CachePanel).reload()  # the run may have added entries
        else:
            if not info.active:
                self._pause_live()
            self._read_events()  # a stopped run: once, for the probes it finished

    def _pause_live(self) -> None:
        if self._timer is not None:
            self._timer.pause()

    def _tick(self) -> None:
        if self.screen not in self.app.screen_stack:  # another screen is shown: go on when this one is again
            self._pause_live()
            return
        self._read_events()

    def _read_events(self) -> None:
        state = self._reported
        if self._reading is not None or state is None:
            return
        self._reading = state
        self._read_new_events(state)

    @work(thread=True, exclusive=True, group="ablation-events", exit_on_error=False)
    def _read_new_events(self, state: ReportedState) -> None:
        reply(self, EventsRead, state, state.read)  # one read at a time: the events file is read on from its end

    @work(thread=True, exclusive=True, group="ablation-results", exit_on_error=False)
    def _read_results(self, run_dir: Path) -> None:
        reply(self, ResultsRead, run_dir, lambda: load_results(run_dir))

    @on(EventsRead)
    def _events_read(self, message: EventsRead) -> None:
        self._reading = None
        if not message.failed and message.key is self._reported and message.key.probes.add(message.value):
            self._redraw()

    @on(ResultsRead)
    def _results_read(self, message: ResultsRead) -> None:
        if self.info is not None and message.key == self.info.dir:  # else another run is shown by now
            self.results, self.problem = message.value, message.reason
            self._redraw()

    # -- drawing ----------------------------------------------------------------------------------------------

    def _rows(self) -> list[ResultRow] | list[ReportedProbe]:
        if self.results is not None:
            return list(self.results.rows)
        return self._reported.rows() if self._reported is not None else []

    def _redraw(self) -> None:
        self.query_one("#ablation-head", Static).update(self._head())
        # the summary and file list of the base view repeat what the table says; kept for runs without results
        self.query_one("#results-text").display = self.results is None and not (self.info and self.info.active)
        if self.info is not None or self.views_ready:
            self.with_views(self._redraw_views)

    def _redraw_views(self) -> None:
        rows = self._rows()
        self.query_one(CachePanel).run_going = self.info is not None and self.info.active
        self.query_one(ProbeTable).show_rows(rows, self.split)
        self.query_one(AccuracyPlot).show(self._plot_data(rows))

    def _head(self) -> Content:
        info = self.info
        if info is None:
            return Content("Probes show here as they finish, as a table and a plot.")
        if self.results is not None:
            return self._results_head(self.results)
        if info.status == "finished":
            return Content.from_markup("[$error]$problem[/]", problem=self.problem) if self.problem else Content("…")
        probes = self._reported.probes if self._reported is not None else None
        done = len(probes.rows) if probes else 0
        total = f" of {probes.total}" if probes and probes.total else ""
        parts = [f"{done}{total} probes finished"]
        if probes and probes.features:
            parts.append(f"features {probes.features} ({probes.features_cached} from the cache)")
        lead = "live" if info.active else info.status
        return Content.from_markup("[b]$lead[/] · $rest", lead=lead, rest=" · ".join(parts))

    @staticmethod
    def _results_head(results: AblationResults) -> Content:
        info = results.info
        cache = info.get("cache") if isinstance(info.get("cache"), dict) else {}
        lookups = int(cache.get("hits", 0)) + int(cache.get("misses", 0))
        chance = f"chance {results.chance:.3f}" if results.chance is not None else ""
        parts = [
            f"{len(results.rows)} probes × {info.get('num_runs', '?')} seeds",
            f"{info.get('samples', '?')} samples, {info.get('classes', '?')} classes",
            chance,
            f"{info.get('device', '?')} {info.get('precision', '')}".strip(),
            f"cache {cache.get('hits', 0)}/{lookups} hits" if lookups else "",
        ]
        return Content(" · ".join(p for p in parts if p))

    def _plot_data(self, rows: list[ResultRow] | list[ReportedProbe]) -> PlotData:
        whole = {r.representation: acc for r in rows if r.layer_index is None and (acc := r.accuracy(self.split))}
        if self.results is not None:
            note = f"mean of {self.results.info.get('num_runs', '?')} seeds"
            return PlotData(self.split, series_of(rows, self.split), whole, self.results.chance, note)
        if self.info is None:
            return PlotData(self.split, {}, empty="No probing run yet.")
        if self.split != "test":
            empty = f"No {self.split} accuracy yet: a running run reports test accuracy; the rest comes at its end."
            return PlotData(self.split, {}, empty=empty)
        state = self._reported
        total = state.probes.total if state is not None else None
        note = f"{len(rows)}{f' of {total}' if total else ''} probes"
        series = series_of(rows, self.split)
        # every per-layer representation of the run from the start: each keeps its colour as its probes arrive
        order = [n for n in (state.order or []) if split_representation(n)[1] != ALL_LAYERS_VARIANT] if state else []
        series = {name: series.get(name, []) for name in order} | series
        return PlotData(self.split, series, whole, note=note, empty="No probe has finished yet.")
