"""Search: largest micro-batch, accumulation modes, candidates, curriculum stages, samples per anchor."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.planner.model_spec import spec_from_config
from gpuopt_tui.core.planner.search import (
    CLOSED_FORM_HEADROOM,
    Budget,
    Stage,
    accumulate_for,
    accumulation,
    candidates,
    closed_form,
    largest_batch,
    largest_batch_for,
    max_samples,
    recommend,
)
from gpuopt_tui.core.planner.train_setup import TrainSetup

GIB = 1024**3


def linear(base: int, per_sequence: int):
    return lambda setup: base + per_sequence * setup.sequences


def test_largest_batch_matches_brute_force() -> None:
    rng = random.Random(0)
    setup = TrainSetup()
    for _ in range(60):
        base, per = rng.randint(0, 1_000), rng.randint(1, 50)
        limit = rng.randint(0, 4_000)
        peak = linear(base, per)
        brute = max((b for b in range(1, limit + 2) if peak(setup.with_batch(b)) <= limit), default=0)
        assert largest_batch(peak, setup, limit) == brute


def test_exact_accumulation_uses_divisors() -> None:
    a = accumulation(b_max=40, target=96)
    assert (a.micro_batch, a.accumulate, a.effective, a.deviation) == (32, 3, 96, 0.0)
    a = accumulation(b_max=40, target=256, n_gpus=4)
    assert (a.micro_batch, a.accumulate, a.effective) == (32, 2, 256)
    assert accumulation(b_max=500, target=64).accumulate == 1
    with pytest.raises(UserError, match="not divisible"):
        accumulation(b_max=40, target=97, n_gpus=2)


def test_approximate_accumulation_shows_the_deviation() -> None:
    a = accumulation(b_max=45, target=225, mode="approx")
    assert (a.micro_batch, a.accumulate, a.effective) == (45, 5, 225)
    a = accumulation(b_max=40, target=100, mode="approx")
    assert a.micro_batch == 40 and a.effective == a.micro_batch * a.accumulate
    assert a.deviation == pytest.approx(a.effective / 100 - 1)
    assert abs(a.deviation) <= 0.2


def test_candidates_are_distinct_and_report_memory() -> None:
    setup = TrainSetup(micro_batch=4, accumulate=16)
    budget = Budget(24 * GIB, 0.85)
    peak = linear(2 * GIB, 200 * 1024**2)
    b_max = largest_batch_for(peak, setup, budget.limit, 64)
    found = candidates(peak, setup, budget, 64, b_max, budget.limit)
    assert len({(c.micro_batch, c.accumulate) for c in found}) == len(found)
    assert all(c.fits and c.peak == peak(setup.with_batch(c.micro_batch, c.accumulate)) for c in found)
    assert all(c.utilisation == c.peak / budget.gpu_total for c in found)
    assert found[0].label == "exact effective batch" and found[0].effective_batch == 64


def test_recommend_keeps_the_effective_batch_and_uses_the_budget() -> None:
    spec = spec_from_config(
        {
            "model_type": "bert",
            "vocab_size": 30522,
            "hidden_size": 768,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "intermediate_size": 3072,
        }
    )
    setup = TrainSetup(micro_batch=4, accumulate=16, trainable="lora", gradient_checkpointing=True)
    budget = Budget(24 * GIB, 0.85)
    rec = recommend(closed_form(spec), setup, budget)
    assert rec.target == 64 and rec.chosen.effective_batch == 64 and rec.chosen.fits
    assert rec.current is not None and rec.current.micro_batch == 4
    assert rec.chosen.micro_batch == 64 and rec.chosen.accumulate == 1


def test_stages_bind_the_micro_batch_and_get_their_sample_limits() -> None:
    setup = TrainSetup(micro_batch=4, accumulate=8)
    budget = Budget(10_000, 1.0)
    peak = linear(1_000, 10)
    stages = [Stage("01.yaml", 32, 24), Stage("02.yaml", 16, 8)]
    rec = recommend(peak, setup, budget, target=32, mode="approx", stages=stages)
    first, second = rec.stages
    assert first.b_max == (10_000 - 1_000) // (10 * 57) == 15
    assert second.b_max == (10_000 - 1_000) // (10 * 25) == 36
    assert rec.b_max == 15 and rec.chosen.micro_batch == 15
    # at the chosen batch both stages could take (9000 / 150) - 1 = 59 samples per anchor, ratio kept
    assert (first.max_positives, first.max_negatives) == (34, 25)
    assert (second.max_positives, second.max_negatives) == (39, 20)


def test_max_samples_keeps_the_ratio_and_handles_none() -> None:
    peak = linear(0, 1)
    setup = TrainSetup(micro_batch=2, n_positives=2, n_negatives=1)
    assert max_samples(peak, setup, limit=2 * 31) == (20, 10)
    assert max_samples(peak, TrainSetup(), limit=100) == (0, 0)


def test_nothing_fits_explains_what_to_try() -> None:
    with pytest.raises(UserError, match="micro-batch of 1 needs .*gradient checkpointing, LoRA"):
        recommend(linear(GIB, GIB), TrainSetup(), Budget(GIB, 0.85))


def test_headroom_keeps_part_of_the_budget_back_for_the_peak_model() -> None:
    setup = TrainSetup(micro_batch=4)
    budget = Budget(24 * GIB, 0.85)
    peak = linear(2 * GIB, 10 * 1024**2)
    full = recommend(peak, setup, budget, target=1 << 20, mode="approx")
    kept = recommend(peak, setup, budget, target=1 << 20, mode="approx", headroom=CLOSED_FORM_HEADROOM)
    assert kept.b_max == largest_batch(peak, setup, int(budget.limit * (1 - CLOSED_FORM_HEADROOM))) < full.b_max
    assert kept.chosen.peak <= (1 - CLOSED_FORM_HEADROOM) * budget.limit < full.chosen.peak <= budget.limit
    assert (kept.headroom, full.headroom) == (CLOSED_FORM_HEADROOM, 0.0)
    with pytest.raises(UserError, match="less 5% kept for the estimate's error"):
        recommend(linear(int(0.84 * GIB), 0), setup, Budget(GIB, 0.85), headroom=CLOSED_FORM_HEADROOM)


def test_the_next_divisor_inside_the_kept_back_share_is_named() -> None:
    """Falcon-1B's case on an H200: 16 x 4 chosen, 32 x 2 at 99% of the budget, over what the traced tier plans for
    (95%) but within the budget: the recommendation names it for the user to measure, and nothing else."""
    setup, budget = TrainSetup(micro_batch=8, accumulate=8), Budget(40 * GIB, 0.85)
    per_sequence = 1024**3  # 1 GiB a sequence over 1 GiB of states: 32 sequences are 97% of the 34 GiB limit
    rec = recommend(linear(GIB, per_sequence), setup, budget, target=64, headroom=0.05)
    assert (rec.chosen.micro_batch, rec.chosen.accumulate) == (16, 4)
    nxt = rec.within_reserve
    assert nxt is not None and (nxt.micro_batch, nxt.accumulate, nxt.effective_batch) == (32, 2, 64)
    assert rec.limit < nxt.peak == GIB + 32 * per_sequence <= budget.limit and nxt.fits
    assert recommend(linear(GIB, per_sequence), setup, budget, target=64).within_reserve is None  # nothing kept back
    too_big = recommend(linear(GIB, int(1.2 * per_sequence)), setup, budget, target=64, headroom=0.05)
    assert too_big.within_reserve is None  # 32 x 2 over the budget itself
    approx = recommend(linear(GIB, per_sequence), setup, budget, target=64, mode="approx", headroom=0.05)
    assert approx.within_reserve is None  # approx mode takes the largest micro-batch anyway
    # an effective batch of twice a 19-digit prime: its only divisor above 2 is out of reach of any budget, and
    # looking for it stops at the largest micro-batch the budget holds instead of counting up to the prime
    huge = recommend(linear(GIB, per_sequence), setup, budget, target=2 * (2**61 - 1), headroom=0.05)
    assert huge.chosen.micro_batch == 2 and huge.within_reserve is None


def _peak_model(base: int, per_sequence: int, kept: int):
    """A peak that grows with the sequences and is higher while accumulating (gradients kept between steps)."""
    return lambda setup: base + per_sequence * setup.sequences + (kept if setup.accumulate > 1 else 0)


@settings(max_examples=150, deadline=None)
@given(
    base=st.integers(0, 2_000),
    per_sequence=st.integers(1, 60),
    kept=st.integers(0, 3_000),
    limit=st.integers(1_000, 60_000),
    target=st.integers(1, 600),
    n_gpus=st.sampled_from([1, 2, 4]),
    micro=st.integers(1, 64),
    accumulate=st.integers(1, 16),
    headroom=st.sampled_from([0.0, 0.05]),
    mode=st.sampled_from(["exact", "approx"]),
)
def test_the_candidate_table_agrees_with_itself(
    base: int,
    per_sequence: int,
    kept: int,
    limit: int,
    target: int,
    n_gpus: int,
    micro: int,
    accumulate: int,
    headroom: float,
    mode: str,
) -> None:
    """Every row is one evaluation at the micro-batch and accumulation it shows, judged against the limit the search
    planned for; the largest micro-batch is a row that fits, and one more does not fit at the accumulation it would
    get; the recommendation is a row that fits."""
    peak = _peak_model(base, per_sequence, kept)
    setup = TrainSetup(micro_batch=micro, accumulate=accumulate, n_gpus=n_gpus)
    budget = Budget(limit, 1.0)
    try:
        rec = recommend(peak, setup, budget, target=target, mode=mode, headroom=headroom)
    except UserError:  # nothing fits, or no exact split: then no table to check
        return
    room = rec.limit
    assert room == budget.search_limit(headroom)
    rows = [rec.chosen, *rec.candidates, *([rec.current] if rec.current else [])]
    for row in rows:
        assert row.peak == peak(setup.with_batch(row.micro_batch, row.accumulate))
        assert row.fits == (row.peak <= room)
        assert row.effective_batch == row.micro_batch * row.accumulate * n_gpus
    assert rec.chosen.fits and (mode == "approx" or rec.chosen.effective_batch == target)
    assert rec.b_max_accumulate == accumulate_for(rec.b_max, target, n_gpus)
    largest = [c for c in rec.candidates if (c.micro_batch, c.accumulate) == (rec.b_max, rec.b_max_accumulate)]
    assert len(largest) == 1 and largest[0].fits
    beyond = rec.b_max + 1
    assert peak(setup.with_batch(beyond, accumulate_for(beyond, target, n_gpus))) > room
    for row in rec.candidates:  # rows at the accumulation the target gives them never pass the largest
        if row.fits and row.accumulate == accumulate_for(row.micro_batch, target, n_gpus):
            assert row.micro_batch <= rec.b_max


def test_the_largest_batch_is_found_at_the_accumulation_it_gets() -> None:
    """Gradients kept while accumulating cost 1000. For a target of 64, micro-batches 43 and up get accumulation 1,
    26-42 accumulation 2. A 10000 limit allows (10000 - 1000) / 100 = 90 at accumulation 1; a 5000 limit allows 40
    at accumulation 1 (below 43: those get 2) and (5000 - 2000) / 100 = 30 at accumulation 2, not 40."""
    peak = _peak_model(1_000, 100, 1_000)
    setup = TrainSetup(micro_batch=8, accumulate=8)
    rec = recommend(peak, setup, Budget(10_000, 1.0), target=64, mode="approx")
    assert (rec.b_max, rec.b_max_accumulate) == (90, 1)
    tight = recommend(peak, setup, Budget(5_000, 1.0), target=64, mode="approx")
    assert (tight.b_max, tight.b_max_accumulate) == (30, 2)
    assert (tight.chosen.micro_batch, tight.chosen.accumulate, tight.chosen.peak) == (30, 2, 5_000)


def _counted(peak):
    """`peak`, counting its calls in `calls[0]`."""
    calls = [0]

    def counted(setup: TrainSetup) -> int:
        calls[0] += 1
        return peak(setup)

    return counted, calls


@pytest.mark.parametrize("target", [64, 10**7, 10**9, 10**30])
def test_the_search_costs_a_few_dozen_peaks_whatever_the_target(target: int) -> None:
    """A config's huge batch makes a huge target: the search bisects instead of trying every accumulation."""
    peak, calls = _counted(_peak_model(1_000, 100, 1_000))
    setup = TrainSetup(micro_batch=4, accumulate=max(1, target // 4))
    rec = recommend(peak, setup, Budget(10_000, 1.0), target=target, mode="approx")
    assert calls[0] < 200
    assert rec.b_max == (90 if target <= 90 * 1.5 else 80)  # 9000 / 100 at accumulation 1, 8000 / 100 above
    exact = recommend(peak, setup, Budget(10_000, 1.0), target=target, mode="exact")
    assert exact.chosen.effective_batch == target and exact.chosen.fits


@settings(max_examples=100, deadline=None)
@given(
    base=st.integers(0, 2_000),
    per_sequence=st.integers(1, 60),
    kept=st.integers(0, 3_000),
    limit=st.integers(1_000, 60_000),
    target=st.integers(1, 3_000),
    n_gpus=st.sampled_from([1, 2, 3, 4]),
    upper=st.integers(1, 400),
)
def test_the_largest_batch_for_a_target_matches_brute_force(
    base: int, per_sequence: int, kept: int, limit: int, target: int, n_gpus: int, upper: int
) -> None:
    peak = _peak_model(base, per_sequence, kept)
    setup = TrainSetup(n_gpus=n_gpus)
    fits = [b for b in range(1, upper + 1) if peak(setup.with_batch(b, accumulate_for(b, target, n_gpus))) <= limit]
    assert largest_batch_for(peak, setup, limit, target, upper) == max(fits, default=0)
