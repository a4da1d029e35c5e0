"""A sample of hundreds of thousands of tokens in attributions.jsonl: the results view opens it, shows its first
tokens with a note counting the others, and goes back at once (the whole sample once took 10 s to open and kept
escape waiting)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from textual.widgets import DataTable, Static

from gpuopt_tui.app import make_app
from gpuopt_tui.core.results.attribution import JSONL_NAME, SHOWN_TOKENS
from gpuopt_tui.ui.widgets.attribution_view import AttributionRunResults

from .conftest import frozen_run, wait_for

TOKENS = 200_000
SECONDS = 8.0  # generous for a loaded 2-core machine: the whole sample took 10 s to open, more to leave


def long_sample_run(runs_root: Path, tokens: int) -> Path:
    """The frozen attribution run with its attributions.jsonl replaced by its first sample, `tokens` long."""
    run_dir = frozen_run("attribution", runs_root)
    jsonl = run_dir / "results" / JSONL_NAME
    record = json.loads(jsonl.read_text(encoding="utf-8").splitlines()[0])
    record["tokens"] = [f"w{i % 97}" for i in range(tokens)]
    record["scores"] = [((i * 37) % 101 - 50) / 50 for i in range(tokens)]
    jsonl.write_text(json.dumps(record) + "\n", encoding="utf-8")
    return run_dir


async def test_a_long_sample_opens_cut_with_a_note_and_escape_leaves_at_once(runs_root: Path) -> None:
    long_sample_run(runs_root, TOKENS)
    app = make_app(screen="attribution")
    async with app.run_test(size=(120, 40)) as pilot:
        results = app.screen.query_one(AttributionRunResults)
        start = time.monotonic()
        await wait_for(pilot, lambda: results.query_one("#sample-table", DataTable).row_count == 1)
        heatmap = results.query_one("#heatmap", Static)
        await wait_for(pilot, lambda: "more tokens" in str(heatmap.content))
        await pilot.pause()
        assert time.monotonic() - start < SECONDS
        kept, note = str(heatmap.content).splitlines()
        assert len(kept.split()) == SHOWN_TOKENS
        assert note == f"… {TOKENS - SHOWN_TOKENS:,} more tokens: see {JSONL_NAME}"
        await pilot.press("ctrl+o")  # the results on the whole screen, then back
        await pilot.pause()
        start = time.monotonic()
        await pilot.press("escape")
        await pilot.pause()
        assert time.monotonic() - start < SECONDS
