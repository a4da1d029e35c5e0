"""Every screen as an SVG snapshot at 120x40, and a legibility check of each at 80x24.

Update the snapshots after an intended change with `pytest tests/ui/test_snapshots.py --snapshot-update` and
look at the report. The data shown is made stable: a data directory that does not exist (no runs, no user
profiles, the same paths everywhere) and, whatever the machine has, a GPU source that replays one sample of
h200_ig_bench.jsonl (NVML samples recorded on an NVIDIA H200 during the IG benchmark) after the ones before it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot

from gpuopt_tui.app import GpuOptApp, make_app
from gpuopt_tui.core.telemetry import read_trace
from gpuopt_tui.ui.gpu_telemetry import GpuTelemetry, busiest_sample
from gpuopt_tui.ui.screens.kind import check_profile_name
from gpuopt_tui.ui.screens.registry import SCREENS
from gpuopt_tui.ui.widgets.confirm import ConfirmDialog
from gpuopt_tui.ui.widgets.prompt import TextPrompt

from .conftest import screen_lines, settle

# what each screen must show even at 80x24, and the widget that must keep a usable height there (a kind screen
# shows its form there; its run pane is the other tab)
LEGIBLE = {
    "dashboard": (("Runs", "status", "No runs yet"), "#dashboard-runs", 5),
    "attribution": (("Profile", "demo-attribution", "Run & results", "[run]"), ".form-fields", 12),
    "tracin": (("Profile", "demo-tracin", "Run & results", "[run]"), ".form-fields", 12),
    "ablation": (("Profile", "demo-ablation", "Run & results", "[run]"), ".form-fields", 12),
    "planner": (("Profile", "demo-plan", "Run & results", "[run]"), ".form-fields", 12),
    "runs": (("status", "No run selected."), "#runs-table", 5),
    "gpu": (("GPU 0  NVIDIA H200", "/140.4 GiB", "PID"), "#gpu-processes", 1),
    "help": (("gpuopt-tui configures",), "#help-body", 10),
}


@pytest.fixture(autouse=True)
def stable_data(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUOPT_TUI_HOME", "/nonexistent/gpuopt-tui-snapshots")  # paths on screen stay the same
    monkeypatch.setenv("GPUOPT_TUI_RUNS_DIR", "/nonexistent/gpuopt-tui-snapshots/runs")


H200 = Path(__file__).parents[1] / "fixtures" / "traces" / "h200_ig_bench.jsonl"
BUSY = busiest_sample(read_trace(H200))  # the benchmark's largest batch


def app_on(screen: str) -> GpuOptApp:
    """The app on `screen`, its GPU panel and GPU screen still on one sample of the H200 trace."""
    return make_app(screen=screen, telemetry=GpuTelemetry.from_trace(H200, BUSY, BUSY + 1, speed=None, loop=False))


SCREEN_NAMES = [s.name for s in SCREENS]
IDS = [f"{name}-screen" for name in SCREEN_NAMES]  # a bare "gpu" id would read as the gpu marker


@pytest.mark.parametrize("screen", SCREEN_NAMES, ids=IDS)
def test_screen_snapshot(screen: str, snap_compare: Any) -> None:
    assert snap_compare(app_on(screen), terminal_size=(120, 40), run_before=settle)


DIALOGS = {
    "confirm": lambda: ConfirmDialog("Cancel run 20270115-080000-attribution-1a2b (attribution: demo)?", "Cancel run"),
    "prompt": lambda: TextPrompt("Save the profile as (a name):", "my-demo-attribution", check_profile_name),
}


# the widget of a kind screen's run pane that must get a usable height at 80x24
RUN_PANE = {
    "attribution": "#run-results",
    "tracin": "#run-results",
    "ablation": "#run-results",
    "planner": "#plan-tabs",
}


@pytest.mark.parametrize("screen", list(RUN_PANE))
async def test_the_run_pane_is_usable_at_80x24(screen: str) -> None:
    """ctrl+l swaps the form for the latest run and its results, which get most of the height; ctrl+l again
    brings the form back. At 120x40 both are shown and there is nothing to swap."""
    app = app_on(screen)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert "Latest run" not in "\n".join(screen_lines(app))
        await pilot.press("ctrl+l")
        await pilot.pause()
        text = "\n".join(screen_lines(app))
        assert "Latest run" in text and not app.screen.query_one(".form-fields").region.height
        assert app.screen.query_one(RUN_PANE[screen]).region.height >= 8
        await pilot.press("ctrl+l")
        await pilot.pause()
        assert app.screen.query_one(".form-fields").region.height >= 12
    async with app_on(screen).run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        assert "Latest run" in "\n".join(screen_lines(pilot.app))
        assert not pilot.app.screen.check_action("switch_pane", ())


@pytest.mark.parametrize("dialog", DIALOGS)
def test_dialog_snapshot(dialog: str, snap_compare: Any) -> None:
    """The dialogs style themselves: a framed box over the dimmed dashboard, both buttons shown."""

    async def ask(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        pilot.app.push_screen(DIALOGS[dialog]())
        await settle(pilot)
        assert [b.display for b in pilot.app.screen.query("Button")] == [True, True]

    assert snap_compare(app_on("dashboard"), terminal_size=(120, 40), run_before=ask)


@pytest.mark.parametrize("screen", SCREEN_NAMES, ids=IDS)
async def test_legible_at_80x24(screen: str) -> None:
    words, widget, min_height = LEGIBLE[screen]
    app = app_on(screen)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        lines = screen_lines(app)
        assert all(len(line) == 80 for line in lines)
        assert all(s.short in lines[0] for s in SCREENS), lines[0]
        assert "Quit" in lines[-1] or "palette" in lines[-1], lines[-1]
        text = "\n".join(lines)
        for word in words:
            assert word in text, (word, text)
        if widget:
            assert app.screen.query_one(widget).region.height >= min_height
