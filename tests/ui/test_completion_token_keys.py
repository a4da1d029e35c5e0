"""`,` and `.` choose the completion token a causal LM run's heatmap explains wherever the focus is in its results: a
results screen opened from the Runs screen (its tab bar focused) takes them at once, left and right still switch
its tabs, and a run without per-token rows (a classifier's, a causal LM's without per_target_token) is left as it is.
On the frozen runs of tests/fixtures/runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from textual.widgets import DataTable, Input, Static, TabbedContent, Tabs

from gpuopt_tui.app import make_app
from gpuopt_tui.core.results.attribution import write_samples
from gpuopt_tui.ui.screens.results import ResultsScreen
from gpuopt_tui.ui.widgets.app_footer import AppFooter
from gpuopt_tui.ui.widgets.sample_browser import COMPLETION_SEARCH_PLACEHOLDER, SEARCH_PLACEHOLDER

from .conftest import attribution_records, frozen_run, open_samples, wait_for

TOKEN_KEYS = {(",", "Prev token"), (".", "Next token")}
PER_TOKEN_FIELDS = ("token_logprobs", "token_deltas", "token_relative_deltas", "token_top", "matrix")


def token_keys(app: Any) -> set[tuple[str, str]]:
    """The completion-token keys the footer shows."""
    return {(k.display, k.description) for k in app.screen.query_one(AppFooter).keys} & TOKEN_KEYS


def heading(screen: ResultsScreen) -> str:
    return str(screen.view.query_one("#sample-heading", Static).content)


def top_rows(screen: ResultsScreen) -> list[list[str]]:
    table = screen.view.query_one("#sample-top", DataTable)
    return [[cell.plain for cell in table.get_row_at(i)] for i in range(table.row_count)]


def expected_top(top: list[list[Any]]) -> list[list[str]]:
    return [[str(rank), token, str(position), f"{score:+.4g}"] for rank, (position, token, score) in enumerate(top, 1)]


async def test_the_keys_work_at_once_in_a_causal_lm_run_opened_from_the_runs_screen(runs_root: Path) -> None:
    run_dir = frozen_run("attribution-lm", runs_root)
    record = attribution_records(run_dir)[0]
    tokens = record["completion_tokens"]
    first = f"shown: completion token 1 of {len(tokens)} {tokens[0]!r}"
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_samples(pilot, run_dir.name)
        tabs = screen.view.query_one("#attribution-tabs", TabbedContent)
        assert isinstance(app.focused, Tabs) and tabs.active == "tab-samples"  # as the screen opens
        assert token_keys(app) == TOKEN_KEYS
        assert "shown: the whole completion" in heading(screen)
        # the search offers what applies to a causal LM's samples (no classes)
        assert screen.view.query_one("#sample-search", Input).placeholder == COMPLETION_SEARCH_PLACEHOLDER
        await pilot.press("full_stop")
        assert first in heading(screen)
        assert top_rows(screen) == expected_top(record["token_top"][0])
        await pilot.press("full_stop", "comma")
        assert first in heading(screen)
        assert isinstance(app.focused, Tabs)  # the keys moved no focus
        # left and right still switch the tabs; on a tab without the heatmap the keys are not offered and do nothing
        await pilot.press("right")
        await wait_for(pilot, lambda: tabs.active == "tab-top")
        await pilot.pause()
        assert not token_keys(app)
        await pilot.press("full_stop")
        assert first in heading(screen) and tabs.active == "tab-top"
        await pilot.press("left")
        await wait_for(pilot, lambda: tabs.active == "tab-samples")
        await pilot.pause()
        assert token_keys(app) == TOKEN_KEYS
        await pilot.press("comma")
        assert "shown: the whole completion" in heading(screen)
        # the sample table focused: the same keys
        screen.view.query_one("#sample-table", DataTable).focus()
        await pilot.press("full_stop")
        assert first in heading(screen)
        # the search field types them: they are not offered there
        search = screen.view.query_one("#sample-search", Input)
        search.focus()
        await pilot.pause()
        assert not token_keys(app)
        await pilot.press("full_stop")
        assert search.value == "." and first in heading(screen)


def without_per_token_rows(runs_root: Path) -> Path:
    """The frozen causal LM run as a run without per_target_token writes it: its lines lack the per-token fields."""
    run_dir = frozen_run("attribution-lm", runs_root)
    jsonl = run_dir / "results" / "attributions.jsonl"
    write_samples(
        jsonl, [{k: v for k, v in r.items() if k not in PER_TOKEN_FIELDS} for r in attribution_records(run_dir)]
    )
    return run_dir


RUNS_WITHOUT_ROWS = {
    "classifier": lambda root: frozen_run("attribution", root),
    "causal-lm-without-per-token-rows": without_per_token_rows,
}


@pytest.mark.parametrize("run", list(RUNS_WITHOUT_ROWS))
async def test_a_run_without_per_token_rows_is_left_as_it_is(runs_root: Path, run: str) -> None:
    run_dir = RUNS_WITHOUT_ROWS[run](runs_root)
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_samples(pilot, run_dir.name)
        tabs = screen.view.query_one("#attribution-tabs", TabbedContent)
        focused, shown = app.focused, heading(screen)
        assert "shown:" not in shown and not token_keys(app)
        search = SEARCH_PLACEHOLDER if run == "classifier" else COMPLETION_SEARCH_PLACEHOLDER
        assert screen.view.query_one("#sample-search", Input).placeholder == search
        await pilot.press("full_stop", "comma")
        await pilot.pause()
        assert (heading(screen), app.focused, tabs.active) == (shown, focused, "tab-samples")
        await pilot.press("right")
        await wait_for(pilot, lambda: tabs.active == "tab-top")
        await pilot.press("left")
        await wait_for(pilot, lambda: tabs.active == "tab-samples")
