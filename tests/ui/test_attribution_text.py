"""The attribution texts that say which samples ran their steps in full precision (the full_precision_fallback)."""

from __future__ import annotations

from gpuopt_tui.core.attribution_results import Sample, SampleEntry
from gpuopt_tui.core.attribution_summary import StepStats
from gpuopt_tui.ui.widgets.attribution_text import sample_heading, step_report


def entry(full_precision: bool) -> SampleEntry:
    return SampleEntry(
        offset=0, index=7, target=1, label=1, prediction=1, probability=0.9, delta=1e-3, relative_delta=1e-3,
        top_tokens=("good",), search_text="good", steps=33, full_precision=full_precision,
    )  # fmt: skip


def test_a_sample_heading_says_its_steps_ran_in_full_precision() -> None:
    assert "33 steps in full precision" in sample_heading(Sample(entry(True), (), (), False)).plain
    assert "full precision" not in sample_heading(Sample(entry(False), (), (), False)).plain


def test_the_steps_report_carries_the_summary_note() -> None:
    note = "3 of 8 samples ran their steps in tf32, not fp16"
    stats = StepStats("auto", 1e-2, 1025, 200, 25.0, ((9, 5), (33, 3)), 0, None, note)
    assert any(note in line.plain for line in step_report(stats))
    plain = StepStats("auto", 1e-2, 1025, 200, 25.0, ((9, 5), (33, 3)), 0, None)
    assert not any("tf32" in line.plain for line in step_report(plain))
