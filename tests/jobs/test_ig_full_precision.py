"""n_steps = "auto" with bf16 steps and full_precision_fallback: the samples whose output moves too little for bf16
rounding to reach the tolerance run their steps in full precision (fp32 on the CPU), the others in bf16, and
each group's result is what a run of that group alone in its precision gives."""

from __future__ import annotations

import pytest
import torch
from ig_cases import tiny_bert_case

from gpuopt_tui.jobs.attribution import IGOptions, integrated_gradients
from gpuopt_tui.jobs.attribution.adaptive import full_precision, needs_full_precision, precision_floor
from gpuopt_tui.jobs.attribution.deltas import steps_summary

TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def case():
    model, emb, base, mask = tiny_bert_case(seed=3, data_seed=4, rows=12, padded=(2, 7))
    return (lambda e, m, c: model(inputs_embeds=e, attention_mask=m).logits), model, emb, base, mask


def auto(case, rows: torch.Tensor | None = None, target: torch.Tensor | str = "predicted", on_chunk=None, **settings):
    forward, model, emb, base, mask = case
    if rows is not None:
        emb, base, mask = emb[rows], base[rows], mask[rows]
    options = IGOptions(n_steps="auto", tolerance=TOLERANCE, alpha_batch_size=16, **settings)
    return integrated_gradients(forward, emb, base, mask, target, options, model=model, on_chunk=on_chunk)


def test_the_rule_compares_the_precision_floor_with_the_tolerance_share_of_the_change() -> None:
    scores = torch.tensor([4.0, 4.0, 4.0, -2.0])
    baseline = torch.tensor([0.0, 3.0, 3.99, -1.0])
    floor = precision_floor("bf16")  # 8e-3: bf16 can reach 1e-2 of the change when it exceeds 0.8 x max |F|
    flagged = needs_full_precision(scores, baseline, TOLERANCE, "bf16")
    assert flagged.tolist() == [False, True, True, True]
    assert (floor * 4.0 > TOLERANCE * 1.0) and not (floor * 4.0 > TOLERANCE * 4.0)
    # a loose tolerance: bf16 will do, unless the output hardly moves at all (0.01 of 4: below bf16's rounding)
    assert needs_full_precision(scores, baseline, 1.0, "bf16").tolist() == [False, False, True, False]
    assert full_precision(1e-2) == "tf32" and full_precision(1e-4) == "fp32"


def test_each_group_runs_in_its_precision_and_equals_a_run_of_it_alone(case) -> None:
    mixed = auto(case, precision="bf16", cast_weights=True, full_precision_fallback=True)
    routed = mixed.fallback == 1  # before the first pass, by the output change
    assert 0 < int(routed.sum()) < routed.numel()  # both groups in this batch
    # the samples routed are those of the rule, on the fp32 outputs at x and at the baseline
    assert torch.equal(routed, needs_full_precision(mixed.scores, mixed.baseline_scores, TOLERANCE, "bf16"))
    flagged, rest = routed.nonzero().squeeze(1), (~routed).nonzero().squeeze(1)
    fp32 = auto(case, flagged, target=mixed.target[flagged])  # fp32 (TF32 is GPU-only): the fallback on the CPU
    bf16 = auto(
        case, rest, target=mixed.target[rest], precision="bf16", cast_weights=True, full_precision_fallback=True
    )
    torch.testing.assert_close(mixed.attributions[flagged], fp32.attributions, rtol=0, atol=1e-6)
    torch.testing.assert_close(mixed.attributions[rest], bf16.attributions, rtol=0, atol=1e-6)
    assert torch.equal(mixed.steps[flagged], fp32.steps) and torch.equal(mixed.steps[rest], bf16.steps)
    # and the flagged samples are more accurate than in bf16: against a fine fp32 run of the same points' rule
    reference = auto(case, flagged, target=mixed.target[flagged], max_steps=257)
    in_bf16 = auto(case, flagged, target=mixed.target[flagged], precision="bf16", cast_weights=True)
    err_mixed = (mixed.token_scores()[flagged] - reference.token_scores()).abs().amax()
    err_bf16 = (in_bf16.token_scores() - reference.token_scores()).abs().amax()
    assert err_mixed < err_bf16


def test_without_the_fallback_or_in_fp32_no_sample_is_flagged(case) -> None:
    plain = auto(case, precision="bf16", cast_weights=True)
    assert not plain.full_precision.any()
    assert not auto(case, full_precision_fallback=True).full_precision.any()  # fp32 steps need no fallback


def test_progress_covers_both_groups_once(case) -> None:
    seen: list[tuple[int, int]] = []
    auto(
        case,
        precision="bf16",
        cast_weights=True,
        full_precision_fallback=True,
        on_chunk=lambda d, t: seen.append((d, t)),
    )
    totals = {t for _, t in seen}
    assert len(totals) == 1  # one scale over both groups' passes
    done = [d for d, _ in seen]
    assert done == sorted(done) and done[-1] <= totals.pop()


def test_the_summary_counts_and_explains_the_full_precision_samples() -> None:
    steps, within = torch.tensor([17, 17, 33, 25]), torch.ones(4, dtype=torch.bool)
    steps, within = torch.cat([steps, steps[:1]]), torch.cat([within, within[:1]])
    reasons = torch.tensor([0, 1, 3, 2, 4], dtype=torch.int8)
    summary = steps_summary(steps, within, tolerance=1e-2, max_steps=65, precision="fp16", fallback=(reasons, "tf32"))
    full = summary["full_precision"]
    assert full["samples"] == 4 and full["precision"] == "tf32"
    assert full["by_reason"] == {"output change": 1, "measured rounding": 1, "not settled": 1, "measured speed": 1}
    assert "4 of 5 samples ran their steps in tf32, not fp16" in full["note"]
    none = (torch.zeros(4, dtype=torch.int8), "tf32")
    assert steps_summary(steps, within, tolerance=1e-2, max_steps=65, fallback=none)["full_precision"] is None
