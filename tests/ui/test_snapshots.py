"""Every screen as an SVG snapshot at 120x40, and a legibility check of each at 80x24.

Update the snapshots after an intended change with `pytest tests/ui/test_snapshots.py --snapshot-update` and
look at the report. The data shown is made stable: a data directory that does not exist (no runs, no user
profiles, the same paths everywhere) and a GPU source that reports no GPU, whatever the machine has.
"""

from __future__ import annotations

from typing import Any

import pytest
from textual.pilot import Pilot

from gpuopt_tui.app import make_app
from gpuopt_tui.core.telemetry import backend
from gpuopt_tui.ui.screens.registry import SCREENS
from gpuopt_tui.ui.widgets.prompt import TextPrompt

from .conftest import screen_lines, wait_for

# what each screen must show even at 80x24, and the widget that must keep a usable height there
LEGIBLE = {
    "dashboard": (("Runs", "status", "No runs yet"), "#dashboard-runs", 5),
    "attribution": (("Profile", "demo-attribution", "Latest run", "[run]"), ".form-fields", 6),
    "tracin": (("Profile", "demo-tracin", "Latest run", "[run]"), ".form-fields", 6),
    "ablation": (("Profile", "demo-ablation", "Latest run", "[run]"), ".form-fields", 6),
    "planner": (("Profile", "demo-plan", "Latest run", "[run]"), ".form-fields", 6),
    "runs": (("status", "No run selected."), "#runs-table", 5),
    "gpu": (("GPU",), None, 0),
    "help": (("gpuopt-tui configures",), "#help-body", 10),
}


@pytest.fixture(autouse=True)
def stable_data(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUOPT_TUI_HOME", "/nonexistent/gpuopt-tui-snapshots")  # paths on screen stay the same
    monkeypatch.setenv("GPUOPT_TUI_RUNS_DIR", "/nonexistent/gpuopt-tui-snapshots/runs")
    monkeypatch.setattr(backend, "open_source", lambda *args, **kwargs: backend.NoGpuSource("none in snapshot tests"))


async def settle(pilot: Pilot[Any]) -> None:
    await pilot.pause()
    await pilot.app.workers.wait_for_complete()
    await pilot.pause(0.3)


SCREEN_NAMES = [s.name for s in SCREENS]
IDS = [f"{name}-screen" for name in SCREEN_NAMES]  # a bare "gpu" id would read as the gpu marker


@pytest.mark.parametrize("screen", SCREEN_NAMES, ids=IDS)
def test_screen_snapshot(screen: str, snap_compare: Any) -> None:
    assert snap_compare(make_app(screen=screen), terminal_size=(120, 40), run_before=settle)


def test_confirm_dialog_snapshot(snap_compare: Any) -> None:
    async def ask(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        await pilot.press("ctrl+n")  # save as: the name prompt
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, TextPrompt))
        await settle(pilot)

    assert snap_compare(make_app(screen="attribution"), terminal_size=(120, 40), run_before=ask)


@pytest.mark.parametrize("screen", SCREEN_NAMES, ids=IDS)
async def test_legible_at_80x24(screen: str) -> None:
    words, widget, min_height = LEGIBLE[screen]
    app = make_app(screen=screen)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        lines = screen_lines(app)
        assert all(len(line) == 80 for line in lines)
        if screen != "gpu":  # the GPU screen comes with its own title line
            assert all(s.short in lines[0] for s in SCREENS), lines[0]
        assert "Quit" in lines[-1] or "palette" in lines[-1], lines[-1]
        text = "\n".join(lines)
        for word in words:
            assert word in text, (word, text)
        if widget:
            assert app.screen.query_one(widget).region.height >= min_height
