"""Cell-level repaints: which cells a changed line repaints, and what the terminal is sent for them."""

from __future__ import annotations

import re

from rich.segment import Segment
from textual.app import App, ComposeResult
from textual.screen import Screen
from textual.strip import Strip

from gpuopt_tui.ui.partial_updates import CroppingCompositor, crop_partial_updates
from gpuopt_tui.ui.widgets.cell_lines import TextLines, changed_runs


def strip(text: str) -> Strip:
    return Strip([Segment(text)])


def test_only_the_cells_that_changed_are_runs_and_close_runs_are_joined() -> None:
    assert changed_runs(strip("SM 97%"), strip("SM 97%"), 20) == []
    assert changed_runs(strip("SM 97%"), strip("SM 98%"), 20) == [(4, 5)]
    assert changed_runs(strip("SM 97% · memory 10%"), strip("SM 98% · memory 11%"), 30) == [(4, 5), (17, 18)]
    assert changed_runs(strip("45°C 97%"), strip("46°C 98%"), 10) == [(1, 2), (6, 7)]  # 4 cells apart: two
    assert changed_runs(strip("45 97%"), strip("46 98%"), 10) == [(1, 5)]  # 2 cells of the same style: one
    assert changed_runs(strip("100%"), strip("95%"), 6) == [(0, 4)]  # shorter: the old tail is blanked


class LinesScreen(Screen):
    def __init__(self) -> None:
        super().__init__()
        self.cropped = crop_partial_updates(self)

    def compose(self) -> ComposeResult:
        yield TextLines(id="lines")


class LinesApp(App):
    def __init__(self) -> None:
        super().__init__()
        self.sent: list[str] = []

    def get_default_screen(self) -> Screen:
        return LinesScreen()

    def _display(self, screen: Screen, renderable: object) -> None:  # what goes to the terminal
        if renderable is not None and hasattr(renderable, "render_segments"):
            self.sent.append(renderable.render_segments(self.console))
        super()._display(screen, renderable)


async def test_a_changed_figure_sends_only_its_cells() -> None:
    app = LinesApp()
    async with app.run_test(size=(60, 5)) as pilot:
        assert isinstance(app.screen, LinesScreen) and app.screen.cropped
        assert isinstance(app.screen._compositor, CroppingCompositor)
        lines = app.screen.query_one(TextLines)
        lines.set_lines(["Util    SM 97% · memory 10%", "Power   623/700W"])
        await pilot.pause()
        app.sent.clear()
        lines.set_lines(["Util    SM 98% · memory 10%", "Power   623/700W"])
        await pilot.pause()
        sent = "".join(app.sent)
        assert re.findall(r"\x1b\[(\d+;\d+)H", sent) == ["1;13"]  # the cursor goes to the changed cell...
        assert re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", sent) == "8"  # ...and only that cell is written
