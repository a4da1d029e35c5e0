"""n_steps = "auto": nested Clenshaw-Curtis levels refined per sample until the relative completeness delta is
within the tolerance, on tiny random BERT and RoBERTa classifiers in float64 (so that rounding does not blur
the comparisons)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, RobertaConfig, RobertaForSequenceClassification

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.attribution import integrated_gradients
from gpuopt_tui.jobs.attribution.adaptive import level_points, nested_levels, precision_floor, tolerance_warning
from gpuopt_tui.jobs.attribution.deltas import steps_summary
from gpuopt_tui.jobs.attribution.precision import RELATIVE_ERROR
from gpuopt_tui.jobs.attribution.rules import step_rule

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
    auto = integrated_gradients(forward, emb, base, mask, n_steps="auto", tolerance=tolerance, alpha_batch_size=7)
    assert (relative(auto) <= tolerance).all()  # and the token scores moved less than it at the last level
    assert set(auto.steps.tolist()) <= set(level_points(1025)) and auto.steps.min() >= 9
    reference = integrated_gradients(forward, emb, base, mask, n_steps=1000, alpha_batch_size=100)
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
    auto = integrated_gradients(forward, emb, base, mask, n_steps="auto", tolerance=1e-14, max_steps=40)
    assert auto.steps.tolist() == [33] * 8  # the last level within 40 steps
    assert (relative(auto) > 1e-14).any()


def test_refined_sums_equal_the_fixed_rule_of_the_same_points() -> None:
    """Gradients computed at one level and reweighted at the next give exactly each sample's fixed rule."""
    forward, emb, base, mask = case("bert", 1)
    auto = integrated_gradients(forward, emb, base, mask, n_steps="auto", tolerance=1e-5, alpha_batch_size=3)
    assert len(set(auto.steps.tolist())) > 1  # samples stopped at different levels
    for i, steps in enumerate(auto.steps.tolist()):
        one = slice(i, i + 1)
        fixed = integrated_gradients(
            forward, emb[one], base[one], mask[one], auto.target[one], n_steps=steps, method="clenshaw_curtis"
        )
        assert torch.allclose(auto.attributions[one], fixed.attributions, rtol=0, atol=1e-13)
        assert float(auto.deltas[i]) == pytest.approx(float(fixed.deltas[0]), abs=1e-13)


@pytest.mark.parametrize("alpha_batch_size", [1, 5, None])
def test_chunk_sizes_do_not_change_the_result(alpha_batch_size: int | None) -> None:
    forward, emb, base, mask = case("roberta", 2)
    chunks: list[tuple[int, int]] = []
    auto = integrated_gradients(
        forward,
        emb,
        base,
        mask,
        n_steps="auto",
        tolerance=1e-4,
        alpha_batch_size=alpha_batch_size,
        on_chunk=lambda done, total: chunks.append((done, total)),
    )
    whole = integrated_gradients(forward, emb, base, mask, n_steps="auto", tolerance=1e-4, alpha_batch_size=64)
    assert torch.equal(auto.steps, whole.steps)
    assert torch.allclose(auto.attributions, whole.attributions, rtol=0, atol=1e-13)
    assert all(done <= total for done, total in chunks) and chunks == sorted(chunks)


def test_levels_nest_and_each_level_is_its_clenshaw_curtis_rule() -> None:
    levels = nested_levels(300)
    assert [level.points for level in levels] == [5, 9, 17, 33, 65, 129, 257]
    seen: list[float] = []
    for k, level in enumerate(levels):
        seen += level.alphas.tolist()
        alphas, weights = step_rule("clenshaw_curtis", level.points)
        order = np.argsort(seen)
        assert np.allclose(np.sort(seen), alphas, rtol=0, atol=1e-15)
        own = np.concatenate([lv.weights[:, k - j] for j, lv in enumerate(levels[: k + 1])])
        assert np.allclose(own[order], weights, rtol=0, atol=1e-15)
    with pytest.raises(UserError, match="max_steps must be at least 9"):
        level_points(8)


def test_a_sample_whose_output_does_not_move_stops_instead_of_refining_rounding_noise() -> None:
    """F(e) = logits(e) + logits(-e) on the path from -x to x: F(x) = F(baseline) exactly and every attribution
    is 0 but for rounding, so |delta| / |F(x) - F(baseline)| and the token changes are noise over ~0. The
    denominators' floor (a few fp32 rounding units of |F(x)|) stops every sample at the first test."""
    torch.manual_seed(0)
    config = BertConfig(**SIZES, vocab_size=100, max_position_embeddings=40, initializer_range=0.3, num_labels=3)
    model = BertForSequenceClassification(config).eval()
    emb = model.get_input_embeddings()(torch.randint(5, 100, (8, 14))).detach()
    mask = torch.ones(8, 14, dtype=torch.long)

    def forward(e: torch.Tensor, m: torch.Tensor, c: dict) -> torch.Tensor:
        return model(inputs_embeds=e, attention_mask=m).logits + model(inputs_embeds=-e, attention_mask=m).logits

    auto = integrated_gradients(forward, emb, -emb, mask, n_steps="auto", tolerance=1e-2, max_steps=257)
    assert torch.equal(auto.scores, auto.baseline_scores)
    assert auto.attributions.abs().max() < 1e-4 * auto.scores.abs().min()  # rounding only
    assert auto.steps.tolist() == [9] * 8  # not 257: the cap, where the noise would have sent them


def test_a_tolerance_below_the_steps_precision_is_raised_to_it_with_a_warning() -> None:
    assert precision_floor("fp16") == RELATIVE_ERROR["fp16"] and precision_floor("bf16") == RELATIVE_ERROR["bf16"]
    assert precision_floor("fp32", torch.float64) < 1e-13 < precision_floor("fp32") < 1e-5
    warning = tolerance_warning(1e-3, "fp16")
    assert warning is not None and "fp16" in warning and "4e-03" in warning
    assert tolerance_warning(1e-2, "fp16") is None and tolerance_warning(1e-4, "fp32") is None


def test_a_large_output_does_not_loosen_the_token_test() -> None:
    """Outputs shifted by 1000 (F(x) - F(baseline) and every gradient unchanged) under a low-precision floor: the
    token scores must still settle within the tolerance of their own size. An absolute part of floor x |F(x)|
    (8 here) would stop every sample at the first test, its scores far from converged."""
    forward, emb, base, mask = case("bert", 0)

    def shifted(e: torch.Tensor, m: torch.Tensor, c: dict) -> torch.Tensor:
        return forward(e, m, c) + 1000.0

    auto = integrated_gradients(shifted, emb, base, mask, n_steps="auto", tolerance=1e-2, precision="bf16")
    fine = integrated_gradients(shifted, emb, base, mask, n_steps=1025, method="clenshaw_curtis")
    tokens, reference = auto.token_scores(), fine.token_scores()
    error = (tokens - reference).abs().amax(1) / reference.abs().amax(1)
    assert (error <= 1e-2).all(), error
    assert (auto.steps > 9).any()


@pytest.mark.parametrize(("precision", "remedy"), [("fp16", "use_amp = false"), ("fp32", "raise max_steps")])
def test_samples_left_above_the_tolerance_are_told_the_remedy_of_their_precision(precision: str, remedy: str) -> None:
    steps = torch.tensor([9, 65, 65])
    within = torch.tensor([True, False, True])
    summary = steps_summary(steps, within, tolerance=1e-2, max_steps=65, precision=precision)
    assert summary["above_tolerance"] == 1
    assert summary["warning"].startswith("1 of 3 samples stopped at 65 steps") and remedy in summary["warning"]
    assert steps_summary(steps, torch.ones(3, dtype=torch.bool), tolerance=1e-2, max_steps=65)["warning"] is None
