"""The plan report's data (core/planner/report.py): how a memory bar divides its cells among segments, drawn by
ui/plan_report.py for the CLI and the planner screen."""

from __future__ import annotations

from gpuopt_tui.core.planner.report import Segment, bar_cells


def test_each_segment_ends_at_its_rounded_boundary_and_the_rest_is_free() -> None:
    cells = bar_cells([Segment(24, "a"), Segment(36, "b")], gpu_total=100, width=10)
    assert cells == ["a", "a", "b", "b", "b", "b", "", "", "", ""]


def test_a_segment_under_half_a_cell_takes_none_and_moves_no_other() -> None:
    cells = bar_cells([Segment(30, "a"), Segment(4, "tiny"), Segment(30, "b")], gpu_total=100, width=10)
    assert cells == ["a", "a", "a", "b", "b", "b", "", "", "", ""]


def test_more_than_the_card_fills_the_bar_and_stops_at_its_end() -> None:
    cells = bar_cells([Segment(80, "a"), Segment(80, "b")], gpu_total=100, width=5)
    assert cells == ["a", "a", "a", "a", "b"]
