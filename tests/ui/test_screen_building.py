"""What a screen builds: a kind screen with no run mounts no results views (tabs and tables come with results, or
when asked for) and no pane tabs on a wide terminal, and the profile form fits its columns to the width it gets."""

from __future__ import annotations

import pytest
from textual.widgets import DataTable, TabbedContent, Tabs

from gpuopt_tui.app import make_app
from gpuopt_tui.ui.widgets.ablation_view import CachePanel
from gpuopt_tui.ui.widgets.probing_results import ProbingResults
from gpuopt_tui.ui.widgets.profile_form import MIN_VALUE_WIDTH, NOTE_WIDTH, VALUE_WIDTH, ProfileForm, fitted_widths
from gpuopt_tui.ui.widgets.run_results import RunResults

from .conftest import screen_lines, settle, wait_for


@pytest.mark.parametrize("screen", ["attribution", "tracin", "ablation"])
async def test_a_kind_screen_without_a_run_mounts_no_results_views(screen: str) -> None:
    app = make_app(screen=screen)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        results = app.screen.query_one("#run-results", RunResults)
        assert not results.views_ready
        assert not results.query(TabbedContent) and not results.query(DataTable)
        assert len(list(results.walk_children())) <= 4  # the summary text and the log (ablation: head and button)


async def test_the_pane_tabs_are_made_when_the_terminal_gets_narrow_and_show_the_pane_chosen_before() -> None:
    app = make_app(screen="planner")
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        screen = app.screen
        assert not screen.query("#pane-tabs")
        screen.show_pane("run")  # as starting a run does: the run pane is the one a narrow terminal shows
        await pilot.resize_terminal(80, 24)
        await wait_for(pilot, lambda: screen.query_one("#pane-tabs", Tabs).active == "pane-run")
        await pilot.pause()
        assert "Latest run" in "\n".join(screen_lines(app)) and not screen.form.region.height
        await pilot.press("ctrl+l")
        await wait_for(pilot, lambda: screen.form.region.height > 0)


async def test_the_feature_cache_button_mounts_the_views_and_lists_the_cache() -> None:
    app = make_app(screen="ablation")
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        results = app.screen.query_one(ProbingResults)
        assert results.check_action("next_view", ()) is False  # no views to step through yet
        await pilot.click("#ablation-show-cache")
        await wait_for(pilot, lambda: results.query_one(CachePanel).listing is not None)
        assert results.views_ready and results.view == "cache"
        assert not results.query_one("#ablation-show-cache").display  # the Cache tab is there now
        listing = results.query_one(CachePanel).listing
        assert listing is not None
        # what the suite's earlier tests left in the cache decides which of the two the panel says
        said = f"{listing.entries} entries" if listing.entries else "The feature cache is empty"
        await wait_for(pilot, lambda: said in "\n".join(screen_lines(app)))  # once drawn


def test_the_value_column_narrows_before_the_sources_turn_to_tags() -> None:
    key = 24
    assert fitted_widths(66, key) == (VALUE_WIDTH, 66 - 8 - key - VALUE_WIDTH)  # a kind screen's form at 120
    value, note = fitted_widths(50, key)
    assert MIN_VALUE_WIDTH <= value < VALUE_WIDTH and note == NOTE_WIDTH
    assert fitted_widths(46, key) == (10, 4)  # the planner's form at 120: short tags
    assert fitted_widths(20, key)[0] == MIN_VALUE_WIDTH  # never narrower: the table scrolls sideways then


async def test_the_planner_form_shows_each_keys_value_and_source_at_120x40() -> None:
    app = make_app(screen="planner")
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        form = app.screen.query_one(ProfileForm)
        table = form.table
        assert table.virtual_size.width <= table.scrollable_content_region.width  # nothing cut at the right
        region = form.region
        lines = [line[region.x : region.right] for line in screen_lines(app)[region.y : region.bottom]]
        for key, value, tag in (("precision", "bf16-mixed", "file"), ("optimizer", "adamw", "dflt")):
            row = next(line for line in lines if f"  {key} " in line)
            assert row.split() == [key, value, tag], row
