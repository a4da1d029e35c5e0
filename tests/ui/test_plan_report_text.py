"""The plan report's lines about where a recommendation's figures come from (ui/plan_report.py, shared by the CLI
and the planner screen)."""

from __future__ import annotations

from gpuopt_tui.core.planner.search import Budget, recommend
from gpuopt_tui.core.planner.train_setup import TrainSetup
from gpuopt_tui.ui.plan_report import tier_text

GIB = 1024**3


def said(peak_per_sequence: int, tier: str, headroom: float = 0.05) -> str:
    rec = recommend(
        lambda setup: GIB + peak_per_sequence * setup.sequences,
        TrainSetup(micro_batch=8, accumulate=8),
        Budget(40 * GIB, 0.85),
        target=64,
        tier=tier,
        headroom=headroom,
    )
    return " ".join(tier_text(rec).plain.split())


def test_a_next_divisor_inside_the_kept_back_share_is_named_with_how_to_check_it() -> None:
    traced = said(GIB, "traced")
    assert traced.startswith("traced; 5% of the budget kept back for its error: planned for 32.3 GiB of 34.0 GiB")
    assert traced.endswith(
        "micro-batch 32 x accumulate 2 would take 33.0 GiB (97% of the budget): only inside what was kept back; a run "
        "on the GPU (plan --profile) tells whether it holds"
    )
    assert said(GIB, "measured").endswith("a longer run than the probes' tells whether it holds")
    assert "would take" not in said(int(1.2 * GIB), "traced")  # over the budget itself: not offered
    assert said(GIB, "traced", headroom=0.0) == "traced: nothing kept back, the whole 34.0 GiB budget planned for"
