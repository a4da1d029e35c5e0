"""The results browser on frozen run directories of the four demo profiles (tests/fixtures/browse_runs, made by
the real CLI): enter on a run of the Runs screen or the dashboard opens its results in its kind's view, the runs
are filtered and sorted, a file opens in the pager, and quitting with a run going on says it goes on."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable, Input, OptionList, TabbedContent

from gpuopt_tui.app import GpuOptApp, make_app
from gpuopt_tui.core.telemetry.backend import NoGpuSource
from gpuopt_tui.ui.gpu_telemetry import GpuTelemetry
from gpuopt_tui.ui.screens import results as results_screen
from gpuopt_tui.ui.screens.results import ResultsScreen, screen_name
from gpuopt_tui.ui.warmup import ScreenWarmup
from gpuopt_tui.ui.widgets import attribution_view
from gpuopt_tui.ui.widgets.attribution_view import AttributionRunResults
from gpuopt_tui.ui.widgets.confirm import ConfirmDialog
from gpuopt_tui.ui.widgets.file_picker import FilePicker
from gpuopt_tui.ui.widgets.plan_run_view import PlanRunResults
from gpuopt_tui.ui.widgets.planner_view import PlanView
from gpuopt_tui.ui.widgets.probing_results import ProbingResults
from gpuopt_tui.ui.widgets.runs_table import RunsTable
from gpuopt_tui.ui.widgets.tracin_view import PagedTable, TracInResultsView

from .conftest import flat_text, open_from_runs, settle, wait_for, widget_text

FROZEN = Path(__file__).parents[1] / "fixtures" / "browse_runs"
RUNS = {d.name.split("-")[2]: d.name for d in sorted(FROZEN.iterdir()) if d.is_dir()}  # kind -> run id


def lines_of(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture
def frozen_runs(runs_root: Path) -> Path:
    shutil.copytree(FROZEN, runs_root, ignore=shutil.ignore_patterns("README.md"))
    return runs_root


@pytest.mark.parametrize(("kind", "tabs"), [("attribution", "#attribution-tabs"), ("tracin", "#tracin-tabs")])
async def test_left_and_right_switch_the_results_tabs_without_tabbing_first(
    frozen_runs: Path, kind: str, tabs: str
) -> None:
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_from_runs(pilot, app, RUNS[kind])
        await wait_for(pilot, lambda: bool(screen.view.query(tabs)))
        await settle(pilot)
        switch = screen.view.query_one(tabs, TabbedContent)
        first = switch.active
        await pilot.press("right")
        await wait_for(pilot, lambda: switch.active != first)
        await pilot.press("left")
        await wait_for(pilot, lambda: switch.active == first)


async def test_an_attribution_run_opens_in_its_view(frozen_runs: Path) -> None:
    run_id = RUNS["attribution"]
    records = lines_of(frozen_runs / run_id / "results" / "attributions.jsonl")
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_from_runs(pilot, app, run_id)
        view = screen.view
        assert isinstance(view, AttributionRunResults)
        table = view.query_one("#sample-table", DataTable)
        await wait_for(pilot, lambda: table.row_count == len(records))
        assert not view.query_one("#check-run").display  # no form here to start a check from
        view.show_tab("tab-check")
        check = json.loads((frozen_runs / run_id / "results" / "check.json").read_text())
        await wait_for(
            pilot, lambda: f"Optimized vs original on the first {check['n_samples']} samples" in flat_text(app)
        )
        assert run_id in flat_text(app)
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen.__class__.__name__ == "RunsScreen")


async def test_a_tracin_run_opens_in_its_view(frozen_runs: Path) -> None:
    run_id = RUNS["tracin"]
    tests = lines_of(frozen_runs / run_id / "results" / "influence.jsonl")
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_from_runs(pilot, app, run_id)
        assert isinstance(screen.view, TracInResultsView)
        table = screen.view.query_one("#tracin-tests", PagedTable)
        await wait_for(pilot, lambda: table.row_count == len(tests))
        assert [r.index for r in table.records] == [t["index"] for t in tests]


async def test_an_ablation_run_opens_in_its_view(frozen_runs: Path) -> None:
    run_id = RUNS["ablation"]
    rows = json.loads((frozen_runs / run_id / "results" / "results.json").read_text())["rows"]
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_from_runs(pilot, app, run_id)
        assert isinstance(screen.view, ProbingResults)
        await wait_for(pilot, lambda: screen.view.results is not None)  # type: ignore[attr-defined]
        await pilot.pause()
        assert screen.view.query_one("#table", DataTable).row_count == len(rows)


async def test_a_plan_run_opens_in_its_view(frozen_runs: Path) -> None:
    run_id = RUNS["plan"]
    plan = json.loads((frozen_runs / run_id / "results" / "plan.json").read_text())
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_from_runs(pilot, app, run_id)
        assert isinstance(screen.view, PlanRunResults)
        view = screen.view.query_one(PlanView)
        await wait_for(pilot, lambda: view.plan is not None)
        assert view.plan is not None
        chosen = plan["recommendation"]["chosen"]
        assert (view.plan.rec.chosen.micro_batch, view.plan.rec.chosen.accumulate) == (
            chosen["micro_batch"],
            chosen["accumulate"],
        )
        assert f"closed-form estimate of {plan['model']}" in flat_text(app)


async def test_a_run_opened_while_its_screen_made_ahead_mounts_is_shown(
    frozen_runs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm-up makes a kind's results screen next when one of its runs is highlighted: the user may open the run
    before that screen has mounted its widgets; the opening then shows the run once they are."""
    monkeypatch.setattr(ScreenWarmup, "prefer_results", lambda self, kind: None)  # made here instead
    monkeypatch.setattr(ScreenWarmup, "_results_steps", lambda self: iter(()))
    run_id = RUNS["plan"]
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: any(r.id == run_id for r in app.runs.runs))
        made = app.results_opener.prepare("plan")  # made ahead, not mounted
        assert not made.is_mounted
        app.open_results(run_id)
        await wait_for(pilot, lambda: app.screen is made and made.is_mounted)
        await wait_for(pilot, lambda: made.view.query_one(PlanView).plan is not None)
        assert made.run_id == run_id and run_id in flat_text(app)


async def test_enter_on_the_dashboard_opens_any_past_run(frozen_runs: Path) -> None:
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: len(app.runs.runs) == len(RUNS))
        await pilot.pause()
        oldest = app.runs.runs[-1]
        table = app.screen.query_one("#dashboard-runs", RunsTable)
        table.focus()
        table.move_cursor(row=table.row_count - 1)
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ResultsScreen))
        assert app.screen.run_id == oldest.id  # type: ignore[attr-defined]
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.current_mode == "dashboard" and not isinstance(app.screen, ResultsScreen))


async def test_runs_are_filtered_and_sorted(frozen_runs: Path) -> None:
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: len(app.runs.runs) == len(RUNS))
        await pilot.pause()
        table = app.screen.query_one("#runs-table", RunsTable)
        await pilot.press("slash")
        assert isinstance(app.focused, Input)
        await pilot.press(*"TRAC")  # any case, any field
        await pilot.pause()
        assert table.filter_text == "TRAC"
        assert [r.id for r in table.shown] == [RUNS["tracin"]]
        assert table.row_count == 1
        await pilot.press("enter")  # back to the table, the filter kept
        assert app.focused is table
        await pilot.press("slash", *"xyz")  # the field's text is selected: typing replaces it
        await pilot.pause()
        assert table.row_count == 0
        assert "No run matches 'xyz'" in flat_text(app)
        await pilot.press("escape")
        await pilot.pause()
        assert table.row_count == len(RUNS)
        newest_first = [r.id for r in table.shown]
        assert newest_first == sorted(RUNS.values(), reverse=True)
        await pilot.press("o")  # created -> status
        await pilot.press("o")  # -> kind, A to Z
        await pilot.pause()
        assert table.sort_column == "kind"
        assert [r.kind for r in table.shown] == sorted(RUNS)
        assert "kind ▲" in flat_text(app)
        table.sort_by("kind")  # the same column again: the other way
        await pilot.pause()
        assert [r.kind for r in table.shown] == sorted(RUNS, reverse=True)


async def test_a_result_file_opens_in_the_pager(
    frozen_runs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened = tmp_path / "opened.txt"
    pager = tmp_path / "pager"
    pager.write_text(f'#!/bin/sh\nprintf "%s" "$1" > {opened}\n')
    pager.chmod(0o755)
    monkeypatch.setenv("PAGER", str(pager))
    monkeypatch.setattr(GpuOptApp, "suspend", lambda self: nullcontext())  # a headless app has no terminal
    run_id = RUNS["plan"]
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        await open_from_runs(pilot, app, run_id)
        await pilot.press("f")
        await wait_for(pilot, lambda: isinstance(app.screen, FilePicker))
        await pilot.press("enter")  # the first file: results/config.diff or plan.json
        await wait_for(pilot, lambda: opened.exists())
        first = sorted(p.name for p in (frozen_runs / run_id / "results").iterdir())[0]
        assert opened.read_text() == str(frozen_runs / run_id / "results" / first)


async def test_binary_files_are_listed_but_not_offered_to_the_pager(frozen_runs: Path) -> None:
    run_id = RUNS["attribution"]
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        await open_from_runs(pilot, app, run_id)
        await pilot.press("f")
        await wait_for(pilot, lambda: isinstance(app.screen, FilePicker))
        options = app.screen.query_one(OptionList)
        offered = {
            Path(str(option.id)).name: not option.disabled
            for option in (options.get_option_at_index(i) for i in range(options.option_count))
        }
        assert offered["attributions.safetensors"] is False
        assert offered["attributions.jsonl"] and offered["summary.json"] and offered["log.txt"]


async def test_a_missing_pager_falls_back_with_a_message(frozen_runs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[list[str]] = []
    monkeypatch.setenv("PAGER", "no-such-pager-here --flag")
    monkeypatch.setattr(GpuOptApp, "suspend", lambda self: nullcontext())
    monkeypatch.setattr(subprocess, "run", lambda argv, check: ran.append(argv))
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}" if name == "less" else None)
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        await open_from_runs(pilot, app, RUNS["plan"])
        await pilot.press("f")
        await wait_for(pilot, lambda: isinstance(app.screen, FilePicker))
        await pilot.press("enter")
        await wait_for(pilot, lambda: bool(ran))
        assert ran[0][0] == "less"
        await wait_for(pilot, lambda: any("no-such-pager-here" in n.message for n in app._notifications))
        assert any("using less" in n.message for n in app._notifications)


async def test_quitting_with_a_run_going_on_says_it_goes_on(
    live_run: tuple[Path, subprocess.Popen[bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, proc = live_run
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.runs.any_active)
        await pilot.press("q")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        text = " ".join(widget_text(app, ".dialog-text").split())
        assert "1 run is still going" in text and "they go on after you quit" in text
        assert f"gpuopt-tui attach {run_dir.name}" in text
        await pilot.press("n")  # stay
        await wait_for(pilot, lambda: not isinstance(app.screen, ConfirmDialog))
        assert app.is_running
        await pilot.press("q", "y")
        await wait_for(pilot, lambda: not app.is_running)
    assert proc.poll() is None  # the run goes on
    said = " ".join(capsys.readouterr().err.split())  # printed on the terminal after the app's last frame
    assert f"gpuopt-tui attach {run_dir.name}" in said


SNAPSHOT_RUNS = Path("/tmp/gpuopt-tui-browse-snapshots/runs")  # the same path on screen in every test run
READY = {  # when each kind's view has drawn its results
    "attribution": lambda v: v.query_one("#sample-table", DataTable).row_count > 0,
    "tracin": lambda v: v.query_one("#tracin-tests", DataTable).row_count > 0,
    "ablation": lambda v: v.results is not None,
    "plan": lambda v: v.query_one(PlanView).plan is not None,
}


@pytest.mark.parametrize("kind", sorted(READY))
def test_results_snapshot(kind: str, monkeypatch: pytest.MonkeyPatch, snap_compare: Any) -> None:
    """Each kind's view of a frozen run, opened from the Runs screen, at 120x40."""
    shutil.rmtree(SNAPSHOT_RUNS, ignore_errors=True)
    shutil.copytree(FROZEN, SNAPSHOT_RUNS, ignore=shutil.ignore_patterns("README.md"))
    monkeypatch.setenv("GPUOPT_TUI_RUNS_DIR", str(SNAPSHOT_RUNS))
    monkeypatch.setenv("TZ", "UTC")  # creation times on screen
    time.tzset()

    async def opened(pilot: Pilot[Any]) -> None:
        app = pilot.app
        assert isinstance(app, GpuOptApp)
        screen = await open_from_runs(pilot, app, RUNS[kind])
        await wait_for(pilot, lambda: READY[kind](screen.view))
        await settle(pilot)

    try:
        assert snap_compare(make_app(screen="runs"), terminal_size=(120, 40), run_before=opened)
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


OWN_READS = {  # the worker method with which each kind's view reads a run's results itself
    "attribution": (AttributionRunResults, "_load"),
    "tracin": (TracInResultsView, "_read"),
    "ablation": (ProbingResults, "_read_results"),
    "plan": (PlanRunResults, "_read"),
}


@pytest.mark.parametrize("kind", sorted(OWN_READS))
async def test_a_finished_run_is_read_before_its_screen_is_shown(
    kind: str, frozen_runs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's files are read in a thread before the switch and drawn with the screen: the view starts no read of
    its own, and a second opening shows the same screen, with what was read the first time."""
    view_class, method = OWN_READS[kind]
    own_reads: list[object] = []
    monkeypatch.setattr(view_class, method, lambda self, *args: own_reads.append(args))
    monkeypatch.setattr(results_screen, "PREREAD_WAIT_S", 60.0)  # however slow the machine, the read comes first
    reads: list[str] = []
    read_finished = view_class.read_finished.__func__  # type: ignore[attr-defined]

    def counted(cls: type[Any], info: Any) -> Any:
        reads.append(info.id)
        return read_finished(cls, info)

    monkeypatch.setattr(view_class, "read_finished", classmethod(counted))
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        first = await open_from_runs(pilot, app, RUNS[kind])
        await wait_for(pilot, lambda: READY[kind](first.view))
        await settle(pilot)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, ResultsScreen))
        again = await open_from_runs(pilot, app, RUNS[kind])
        assert again is first
        await wait_for(pilot, lambda: READY[kind](again.view))
        await settle(pilot)
        assert RUNS[kind] in flat_text(app)
    assert own_reads == [] and reads == [RUNS[kind]]


async def test_a_read_outlasting_the_wait_is_handed_to_the_attribution_view(
    frozen_runs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read still going when the screen is shown (a large run) is not done twice: the attribution view waits for
    it, reading nothing itself, and draws what it read."""
    monkeypatch.setattr(results_screen, "PREREAD_WAIT_S", 0.001)  # the screen is shown before the read ends
    shown = threading.Event()
    reads: list[Path] = []
    load = attribution_view.load_run_files

    def counted(run_dir: Path, *args: Any) -> Any:
        reads.append(run_dir)
        return load(run_dir, *args)

    def held(cls: type[Any], info: Any) -> Any:
        assert shown.wait(60), "the screen was not shown while the read went on"
        return counted(info.dir)

    monkeypatch.setattr(attribution_view, "load_run_files", counted)
    monkeypatch.setattr(AttributionRunResults, "read_finished", classmethod(held))
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_from_runs(pilot, app, RUNS["attribution"])
        assert "Reading the results" in flat_text(app)
        shown.set()
        await wait_for(pilot, lambda: READY["attribution"](screen.view))
        await settle(pilot)
    assert [d.name for d in reads] == [RUNS["attribution"]]


async def results_picture(kind: str, warmed: bool) -> str:
    """The results screen of the frozen run of `kind` as an SVG, opened once the warm-up is done (`warmed`) or at
    once."""
    app = make_app(screen="runs", telemetry=GpuTelemetry(NoGpuSource("no GPU in this test")))
    async with app.run_test(size=(120, 40)) as pilot:
        made = None
        if warmed:
            await wait_for(pilot, lambda: app.warmup.done)
            made = app.get_screen(screen_name(kind))  # made, laid out and never shown
            assert made.is_mounted and not made.stack_updates and made.size == app.size
        screen = await open_from_runs(pilot, app, RUNS[kind])
        assert screen is made or not warmed
        await wait_for(pilot, lambda: READY[kind](screen.view))
        await settle(pilot)
        return app.export_screenshot()


@pytest.mark.parametrize("kind", sorted(READY))
async def test_a_results_screen_made_ahead_looks_as_one_made_on_opening(
    kind: str, frozen_runs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm-up makes each kind's results screen ahead; the first opening shows that screen, drawn as a screen
    made by the opening itself is."""
    warmed = await results_picture(kind, warmed=True)
    monkeypatch.setattr(ScreenWarmup, "_results_steps", lambda self: iter(()))  # none made ahead
    assert await results_picture(kind, warmed=False) == warmed
