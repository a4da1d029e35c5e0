"""The sample list's keys (`/` search, `s` sort, `[` and `]` pages) work wherever the focus is in an attribution run's
results: a results screen opened from the Runs screen (its tab bar focused) takes them at once, left and right still
switch its tabs, the search field types them, and the footer offers them only on the Samples tab (the page keys only
when there is more than one page). On the frozen classifier run of tests/fixtures/runs (12 samples); the help says
where they work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from textual.widgets import DataTable, Input, Static, TabbedContent, Tabs

from gpuopt_tui.app import make_app
from gpuopt_tui.core.results.attribution_query import QUERY_HELP
from gpuopt_tui.ui.screens.results import ResultsScreen
from gpuopt_tui.ui.widgets import sample_browser
from gpuopt_tui.ui.widgets.app_footer import AppFooter

from .conftest import attribution_records, frozen_run, open_samples, wait_for, widget_text

SAMPLE_KEYS = {("/", "Search"), ("s", "Sort"), ("[", "Prev page"), ("]", "Next page")}
SEARCH_AND_SORT = {("/", "Search"), ("s", "Sort")}


def sample_keys(app: Any) -> set[tuple[str, str]]:
    """The sample list's keys the footer shows."""
    return {(k.display, k.description) for k in app.screen.query_one(AppFooter).keys} & SAMPLE_KEYS


def listed(screen: ResultsScreen) -> list[int]:
    """The sample indices in the sample table, top to bottom."""
    table = screen.view.query_one("#sample-table", DataTable)
    return [int(table.get_row_at(i)[0].plain) for i in range(table.row_count)]


def status(screen: ResultsScreen) -> str:
    return str(screen.view.query_one("#sample-status", Static).content)


async def test_search_and_sort_work_at_once_in_a_run_opened_from_the_runs_screen(runs_root: Path) -> None:
    run_dir = frozen_run("attribution", runs_root)
    samples = attribution_records(run_dir)
    by_delta = [r["index"] for r in sorted(samples, key=lambda r: (-r["relative_delta"], r["index"]))]
    word = samples[0]["top"][0][1]
    with_word = [r["index"] for r in samples if word in [t[1] for t in r["top"]]]
    assert by_delta != [r["index"] for r in samples] and 0 < len(with_word) < len(samples)
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_samples(pilot, run_dir.name)
        tabs = screen.view.query_one("#attribution-tabs", TabbedContent)
        assert isinstance(app.focused, Tabs) and tabs.active == "tab-samples"  # as the screen opens
        assert sample_keys(app) == SEARCH_AND_SORT  # one page: no page keys
        # s sorts at once, the focus stays on the tab bar
        await pilot.press("s")
        assert listed(screen) == by_delta and "largest relative delta first" in status(screen)
        assert isinstance(app.focused, Tabs)
        # left and right still switch the tabs; on another tab the keys are not offered and do nothing
        await pilot.press("right")
        await wait_for(pilot, lambda: tabs.active == "tab-top")
        await pilot.pause()
        assert not sample_keys(app)
        await pilot.press("s", "slash")
        assert listed(screen) == by_delta and isinstance(app.focused, Tabs) and tabs.active == "tab-top"
        await pilot.press("left")
        await wait_for(pilot, lambda: tabs.active == "tab-samples")
        await pilot.pause()
        assert sample_keys(app) == SEARCH_AND_SORT
        # / focuses the search field, which types the keys (they are not offered there); enter goes to the list
        await pilot.press("slash")
        search = screen.view.query_one("#sample-search", Input)
        assert app.focused is search
        await pilot.pause()
        assert not sample_keys(app)
        await pilot.press(*f"top:{word}", "enter")
        assert search.value == f"top:{word}"
        await wait_for(pilot, lambda: status(screen).startswith(f"{len(with_word)} of {len(samples)} samples"))
        assert listed(screen) == [i for i in by_delta if i in with_word]  # the sort is kept
        assert app.focused is screen.view.query_one("#sample-table", DataTable)
        # the sample table focused: the same keys, back to dataset order after the third order
        await pilot.press("s", "s")
        assert listed(screen) == with_word and "dataset order" in status(screen)


async def test_the_page_keys_turn_pages_at_once_and_only_when_there_are_pages(
    runs_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sample_browser, "PAGE_SIZE", 5)  # the run's 12 samples on 3 pages
    run_dir = frozen_run("attribution", runs_root)
    samples = attribution_records(run_dir)
    word = samples[0]["top"][0][1]
    with_word = [r["index"] for r in samples if word in [t[1] for t in r["top"]]]
    assert len(samples) == 12 and len(with_word) <= 5
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_samples(pilot, run_dir.name)
        assert isinstance(app.focused, Tabs)
        assert sample_keys(app) == SAMPLE_KEYS
        assert listed(screen) == [0, 1, 2, 3, 4] and "page 1/3" in status(screen)
        await pilot.press("right_square_bracket", "right_square_bracket", "right_square_bracket")
        assert listed(screen) == [10, 11] and "page 3/3" in status(screen)  # the last page stays the last
        await pilot.press("left_square_bracket")
        assert listed(screen) == [5, 6, 7, 8, 9] and "page 2/3" in status(screen)
        assert isinstance(app.focused, Tabs)
        # a search that leaves one page: the page keys are not offered
        await pilot.press("slash", *f"top:{word}", "enter")
        await wait_for(pilot, lambda: status(screen).startswith(f"{len(with_word)} of 12 samples"))
        await pilot.pause()
        assert listed(screen) == with_word and "page" not in status(screen)
        assert sample_keys(app) == SEARCH_AND_SORT
        await pilot.press("right_square_bracket")
        assert listed(screen) == with_word


async def test_the_help_says_where_the_sample_keys_work() -> None:
    app = make_app(screen="help")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        guide = " ".join(widget_text(app, ".help-guide").split())
        keys = " ".join(widget_text(app, ".help-keys").split())
    assert "the shown tab's keys work at once, wherever the focus is (an attribution run's Samples tab" in guide
    where = "On the Samples tab, wherever the focus is in the results:"
    for key, what in (
        ("/", f"search the samples ({QUERY_HELP})"),
        ("s", "sort the samples"),
        ("[", "previous page of the sample list"),
        ("]", "next page of the sample list"),
    ):
        assert f" {key} {where} {what}" in keys
