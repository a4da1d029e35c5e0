"""n_steps = "auto": adaptive Simpson panels refined per sample until the relative completeness delta and the
token scores' error estimate are within the tolerance, on tiny random BERT and RoBERTa classifiers in float64 (so
that rounding does not blur the comparisons)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, RobertaConfig, RobertaForSequenceClassification

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.attribution import IGOptions, integrated_gradients
from gpuopt_tui.jobs.attribution.adaptive import (
    accumulation_rounding,
    batch_size_note,
    precision_floor,
    standing,
    tolerance_warning,
)
from gpuopt_tui.jobs.attribution.deltas import steps_summary
from gpuopt_tui.jobs.attribution.panels import GRID, NEW_POINTS, SamplePanels, first_positions, step_counts
from gpuopt_tui.jobs.attribution.precision import RELATIVE_ERROR

SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}


def case(arch: str, seed: int) -> tuple:
    torch.manual_seed(seed)
    common = {"vocab_size": 100, "max_position_embeddings": 40, "initializer_range": 0.3, "num_labels": 3}
    if arch == "bert":
        model = BertForSequenceClassification(BertConfig(**SIZES, **common))
    else:
        model = RobertaForSequenceClassification(RobertaConfig(**SIZES, **common, pad_token_id=1))
    model = model.eval().double()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 100, (8, 14), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[5, 4:] = 0
    emb = model.get_input_embeddings()(ids).detach()
    base = torch.zeros_like(emb)
    return (lambda e, m, c: model(inputs_embeds=e, attention_mask=m).logits), emb, base, mask


def relative(result) -> torch.Tensor:
    return result.deltas.abs() / (result.scores - result.baseline_scores).abs()


@pytest.mark.parametrize(("arch", "seed"), [("bert", 0), ("bert", 1), ("roberta", 2)])
@pytest.mark.parametrize("tolerance", [1e-2, 1e-4])
def test_every_sample_reaches_the_tolerance_and_agrees_with_many_fixed_steps(
    arch: str, seed: int, tolerance: float
) -> None:
    forward, emb, base, mask = case(arch, seed)
    auto = integrated_gradients(
        forward, emb, base, mask, options=IGOptions(n_steps="auto", tolerance=tolerance, alpha_batch_size=7)
    )
    assert (relative(auto) <= tolerance).all()  # and the token scores moved less than it at the last level
    assert set(auto.steps.tolist()) <= set(step_counts(1025)) and auto.steps.min() >= 17
    reference = integrated_gradients(forward, emb, base, mask, options=IGOptions(n_steps=1000, alpha_batch_size=100))
    assert (relative(reference) < 1e-9).all()
    # the totals agree within the tolerance (of |F(x) - F(baseline)|), the token scores within 10x that
    change = (reference.scores - reference.baseline_scores).abs()
    totals = auto.attributions.flatten(1).sum(1) - reference.attributions.flatten(1).sum(1)
    assert (totals.abs() <= tolerance * change * (1 + 1e-9)).all()
    tokens, ref_tokens = auto.token_scores(), reference.token_scores()
    error = (tokens - ref_tokens).abs().amax(1) / ref_tokens.abs().amax(1)
    assert (error <= 10 * tolerance).all(), error


def test_samples_that_do_not_converge_stop_at_the_cap() -> None:
    forward, emb, base, mask = case("bert", 0)
    auto = integrated_gradients(
        forward, emb, base, mask, options=IGOptions(n_steps="auto", tolerance=1e-14, max_steps=40)
    )
    assert auto.steps.tolist() == [33] * 8  # 17 + 8 + 8: one more pass would take them to 41
    assert not auto.within.any()  # and every one of them is reported above the tolerance


def naive_auto(forward, emb, base, mask, target, tolerance: float) -> tuple[torch.Tensor, int]:
    """One sample's adaptive panels, every gradient computed afresh one point at a time (nothing reused): its
    attributions and the points it used."""
    diff = emb - base
    cache: dict[int, torch.Tensor] = {}

    def gradient(position: int) -> torch.Tensor:
        point = (base + position / GRID * diff).requires_grad_()
        (grad,) = torch.autograd.grad(forward(point, mask, {})[0, target], point)
        return grad[0]

    with torch.no_grad():
        ends = tuple(float(forward(e, mask, {})[0, target]) for e in (emb, base))
    panels, positions = SamplePanels(emb.shape[1]), first_positions()
    rounding = accumulation_rounding(torch.float64)
    while True:
        for p in positions.tolist():
            cache[p] = gradient(p)
        panels.add(positions, torch.stack([(cache[p] * diff[0]).sum(-1) for p in positions.tolist()]).numpy())
        now = standing(panels, ends, tolerance, rounding)
        if now.within or panels.points + NEW_POINTS > 1025:
            break
        positions = panels.split(now.panel_errors)
    total = sum(w * cache[p] for p, w in panels.weights().items())
    return diff[0] * total, panels.points


def test_reused_gradients_give_what_computing_every_point_afresh_gives() -> None:
    """The batched refinement keeps each pass's gradients and weights them once the panels are final: the same
    attributions, to rounding, as a sample refined alone with every gradient computed again at its point."""
    forward, emb, base, mask = case("bert", 1)
    auto = integrated_gradients(
        forward, emb, base, mask, options=IGOptions(n_steps="auto", tolerance=1e-5, alpha_batch_size=3)
    )
    assert len(set(auto.steps.tolist())) > 1  # samples stopped after different passes
    for i in range(emb.shape[0]):
        one = slice(i, i + 1)
        attributions, points = naive_auto(forward, emb[one], base[one], mask[one], int(auto.target[i]), 1e-5)
        assert points == int(auto.steps[i])
        assert torch.allclose(auto.attributions[i], attributions, rtol=0, atol=1e-13)


def test_token_scores_alone_keep_no_gradient_and_agree() -> None:
    """Without per-dimension attributions each sample's token scores come from its panels' token integrands:
    the same steps and, to rounding, the same scores as summing the kept gradients' attributions per token."""
    forward, emb, base, mask = case("roberta", 2)
    kept = integrated_gradients(forward, emb, base, mask, options=IGOptions(n_steps="auto", tolerance=1e-4))
    tokens = integrated_gradients(
        forward, emb, base, mask, options=IGOptions(n_steps="auto", tolerance=1e-4, per_dimension=False)
    )
    assert tokens.attributions.shape == (*emb.shape[:-1], 1)
    assert torch.equal(tokens.steps, kept.steps)
    assert torch.allclose(tokens.token_scores(), kept.token_scores(), rtol=0, atol=1e-12)
    assert torch.allclose(tokens.deltas, kept.deltas, rtol=0, atol=1e-12)
    fixed = integrated_gradients(forward, emb, base, mask, options=IGOptions(n_steps=20, per_dimension=False))
    assert fixed.attributions.shape == (*emb.shape[:-1], 1)


@pytest.mark.parametrize("alpha_batch_size", [1, 5, None])
def test_chunk_sizes_do_not_change_the_result(alpha_batch_size: int | None) -> None:
    forward, emb, base, mask = case("roberta", 2)
    chunks: list[tuple[int, int]] = []
    auto = integrated_gradients(
        forward,
        emb,
        base,
        mask,
        options=IGOptions(n_steps="auto", tolerance=1e-4, alpha_batch_size=alpha_batch_size),
        on_chunk=lambda done, total: chunks.append((done, total)),
    )
    whole = integrated_gradients(
        forward, emb, base, mask, options=IGOptions(n_steps="auto", tolerance=1e-4, alpha_batch_size=64)
    )
    assert torch.equal(auto.steps, whole.steps)
    assert torch.allclose(auto.attributions, whole.attributions, rtol=0, atol=1e-13)
    assert all(done <= total for done, total in chunks) and chunks == sorted(chunks)


def test_a_split_keeps_every_point_and_adds_the_quarter_points_of_its_halves() -> None:
    panels = SamplePanels(1)
    first = first_positions()
    assert first.tolist() == [k * GRID // 16 for k in range(17)]
    panels.add(first, np.zeros((17, 1)))
    new = panels.split(np.array([0.0, 3.0, 1.0, 2.0]))  # SPLITS = 2: the two worst, [1/4, 1/2] and [3/4, 1]
    halves = [(k * GRID // 8, GRID // 8) for k in (2, 3, 6, 7)]
    assert panels.panels == sorted([(0, GRID // 4), (GRID // 2, GRID // 4), *halves])
    assert new.tolist() == [lo + q * GRID // 32 for lo, _ in halves for q in (1, 3)] and len(new) == NEW_POINTS
    panels.add(new, np.zeros((NEW_POINTS, 1)))
    quarter_points = {lo + q * width // 4 for lo, width in panels.panels for q in range(5)}
    assert set(panels.column) == quarter_points  # every point a node of a panel, none evaluated twice
    assert sum(panels.weights().values()) == pytest.approx(1.0, abs=1e-15)


@pytest.mark.parametrize("degree", [0, 1, 2, 3, 5])
def test_boole_and_the_error_estimate_on_polynomials(degree: int) -> None:
    """Boole's rule integrates quintics exactly; the estimate |S5 - S3| vanishes up to cubics, not beyond."""
    panels = SamplePanels(1)
    first = first_positions()
    alphas = first / GRID
    panels.add(first, (alphas**degree)[:, None])
    now = panels.estimate()
    scores, error = now.scores, now.error
    assert scores[0] == pytest.approx(1 / (degree + 1), abs=1e-14)
    assert (error[0] < 1e-15) == (degree <= 3)
    with pytest.raises(UserError, match="max_steps must be at least 17"):
        integrated_gradients(*case("bert", 0)[:4], options=IGOptions(n_steps="auto", max_steps=16))


def test_a_sample_whose_input_is_its_baseline_stops_at_the_first_pass() -> None:
    """Nothing moves along its path (every integrand value is 0): the absolute parts of both tests let it stop
    at once instead of refining to the cap; the other samples refine as usual."""
    forward, emb, base, mask = case("bert", 0)
    base = base.clone()
    base[3] = emb[3]
    auto = integrated_gradients(
        forward, emb, base, mask, options=IGOptions(n_steps="auto", tolerance=1e-6, max_steps=257)
    )
    assert int(auto.steps[3]) == 17 and torch.equal(auto.attributions[3], torch.zeros_like(emb[3]))
    assert (auto.steps[[0, 1, 2, 4, 5, 6, 7]] > 17).all()


def test_a_tolerance_below_the_steps_precision_gets_a_warning_naming_what_happens() -> None:
    assert precision_floor("fp16") == RELATIVE_ERROR["fp16"] and precision_floor("bf16") == RELATIVE_ERROR["bf16"]
    assert precision_floor("fp32", torch.float64) < 1e-13 < precision_floor("fp32") < 1e-5
    moved = tolerance_warning(1e-3, "fp16", fallback=True)
    assert moved is not None and "4e-03" in moved and "tf32" in moved
    flagged = tolerance_warning(1e-3, "fp16", fallback=False)
    assert flagged is not None and "flagged" in flagged and "use_amp = false" in flagged
    assert tolerance_warning(1e-2, "fp16", True) is None and tolerance_warning(1e-4, "fp32", False) is None


def test_the_tolerance_warning_advises_fp32_only_to_steps_that_are_not_fp32() -> None:
    """fp32 steps (a CPU run) have no finer precision to switch to; tf32 steps switch with tf32, not use_amp."""
    fp32 = tolerance_warning(1e-7, "fp32", fallback=True)
    assert fp32 is not None and "fp32 steps resolve" in fp32
    assert "use_amp" not in fp32 and "run the steps in fp32" not in fp32
    tf32 = tolerance_warning(1e-4, "tf32", fallback=False)
    assert tf32 is not None and "tf32 = false" in tf32 and "use_amp" not in tf32
    assert "use_amp = false" in (tolerance_warning(1e-3, "bf16", fallback=False) or "")


def test_small_gpu_batches_get_a_note_naming_the_setting() -> None:
    assert "batch_size = 32" in batch_size_note(32, 40_000, "cuda")
    assert batch_size_note(128, 40_000, "cuda") is None
    assert batch_size_note(20, 20, "cuda") is None  # all samples in one batch already
    assert batch_size_note(8, 40_000, "cpu") is None  # the figure is a GPU's


def test_a_large_output_does_not_loosen_the_token_test() -> None:
    """Outputs shifted by 1000 (F(x) - F(baseline) and every gradient unchanged) under a low-precision floor: the
    token scores must still settle within the tolerance of their own size. An absolute part of floor x |F(x)|
    (8 here) would stop every sample at the first test, its scores far from converged."""
    forward, emb, base, mask = case("bert", 0)

    def shifted(e: torch.Tensor, m: torch.Tensor, c: dict) -> torch.Tensor:
        return forward(e, m, c) + 1000.0

    auto = integrated_gradients(
        shifted, emb, base, mask, options=IGOptions(n_steps="auto", tolerance=1e-2, precision="bf16")
    )
    fine = integrated_gradients(shifted, emb, base, mask, options=IGOptions(n_steps=1025, method="clenshaw_curtis"))
    tokens, reference = auto.token_scores(), fine.token_scores()
    error = (tokens - reference).abs().amax(1) / reference.abs().amax(1)
    assert (error <= 1e-2).all(), error
    assert (auto.steps > 9).any()


@pytest.mark.parametrize(
    ("precision", "fallback", "remedy"),
    [("fp16", False, "use_amp = false"), ("fp16", True, "raise max_steps"), ("fp32", False, "raise max_steps")],
)
def test_samples_above_the_tolerance_are_counted_named_and_told_the_remedy(
    precision: str, fallback: bool, remedy: str
) -> None:
    steps = torch.tensor([17, 65, 65, 33])
    within = torch.tensor([True, False, True, False])
    reasons = (torch.zeros(4, dtype=torch.int8), "tf32") if fallback else None
    summary = steps_summary(steps, within, tolerance=1e-2, max_steps=65, precision=precision, fallback=reasons)
    assert summary["above_tolerance"] == 2 and summary["above_tolerance_samples"] == [1, 3]
    warning = summary["warning"]
    assert warning.startswith("2 of 4 samples are above the tolerance 0.01") and remedy in warning
    assert "1 stopped at max_steps = 65" in warning and "1 settled as they stopped" in warning
    assert (fallback and precision == "fp16") == ("use_amp = false" not in warning and precision == "fp16")
    assert steps_summary(steps, torch.ones(4, dtype=torch.bool), tolerance=1e-2, max_steps=65)["warning"] is None
