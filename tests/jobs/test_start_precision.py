"""The precision a run's batches start in (start_precision.py): measured once, revised by the samples that fall
back, and a batch that starts in full precision equals a run in that precision with its samples named."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

from gpuopt_tui.core.profiles.attribution import AttributionSection
from gpuopt_tui.jobs.attribution.engine import Settings, attribute_batch
from gpuopt_tui.jobs.attribution.precision import FALLBACK_REASONS, NonFiniteGradients
from gpuopt_tui.jobs.attribution.start_precision import GAIN, LOST, PRIOR_FELL_BACK, StartPrecision
from gpuopt_tui.jobs.models.hf import SequenceClassifierAdapter

SPEED = FALLBACK_REASONS.index("measured speed")
ROUNDING = FALLBACK_REASONS.index("measured rounding")


def timings(reduced: float, full: float) -> tuple[list[str], object]:
    calls: list[str] = []

    def timed(precision: str) -> float:
        calls.append(precision)
        return reduced if precision == "fp16" else full

    return calls, timed


def test_there_is_a_choice_only_for_reduced_auto_steps_with_the_fallback_on_a_gpu() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert StartPrecision.of("fp16", 1e-2, True, cpu) is None
    assert StartPrecision.of("tf32", 1e-2, True, gpu) is None
    assert StartPrecision.of("bf16", 1e-2, False, gpu) is None
    assert StartPrecision.of("fp16", 1e-2, True, gpu) == StartPrecision("fp16", "tf32")
    assert StartPrecision.of("bf16", 1e-4, True, gpu) == StartPrecision("bf16", "fp32")


def test_both_precisions_are_timed_once_after_a_warm_up() -> None:
    start = StartPrecision("fp16", "tf32")
    calls, timed = timings(0.5, 1.0)
    assert start.choose(timed) and start.ratio == 0.5
    assert sorted(calls) == ["fp16"] * 3 + ["tf32"] * 3
    assert start.choose(timed) and len(calls) == 6  # not measured again


def test_the_first_batch_assumes_a_share_of_samples_falls_back() -> None:
    start = StartPrecision("fp16", "tf32", ratio=0.88)  # a RoBERTa classifier's, on an H200
    assert start.expected() == pytest.approx(PRIOR_FELL_BACK * (1 + 0.88 * LOST) + (1 - PRIOR_FELL_BACK) * 0.88)
    assert not start.choose(timings(0.88, 1.0)[1])  # 0.88 alone is within GAIN; with the restarts it is not


def test_no_faster_reduced_precision_starts_in_full_precision_and_names_the_samples() -> None:
    start = StartPrecision("fp16", "tf32")
    assert not start.choose(timings(0.95, 1.0)[1])  # not worth its restarts
    reasons = torch.tensor([0, 2, 0], dtype=torch.int8)  # in a TF32 batch, 2 is TF32 -> fp32
    assert start.observe(False, reasons).tolist() == [SPEED, ROUNDING, SPEED]
    assert start.counts == {"reduced": 0, "routed": 0, "fell_back": 0, "full": 3}


def test_samples_that_fall_back_turn_the_choice_to_full_precision() -> None:
    start = StartPrecision("fp16", "tf32")
    assert start.choose(timings(0.5, 1.0)[1])
    reasons = torch.tensor([2] * 8 + [3] * 4 + [1] * 4 + [0] * 4, dtype=torch.int8)
    assert torch.equal(start.observe(True, reasons), reasons)  # a batch that started in fp16 keeps its reasons
    expected = 4 / 20 + 12 / 20 * (1 + 0.5 * LOST) + 4 / 20 * 0.5
    assert start.expected() == pytest.approx(expected) and expected > GAIN
    assert not start.choose(timings(0.5, 1.0)[1])
    record = start.record()
    assert record["samples"] == {"reduced": 20, "routed": 4, "fell_back": 12, "full": 0}
    assert record["time_ratio"] == 0.5 and "start in fp16 while" in record["rule"]
    assert "took 0.50x the time in fp16 as in tf32" in start.describe() and start.describe().startswith(
        "steps start in tf32"
    )


@pytest.fixture(scope="module")
def case():
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(85)]
    tokenizer = BertTokenizer(vocab={t: i for i, t in enumerate(vocab)})
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=90, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, num_labels=3
    )
    model = BertForSequenceClassification(config).eval()
    adapter = SequenceClassifierAdapter("tiny-bert", model, tokenizer, 3, torch.device("cpu"))
    tokens = adapter.tokenize(["w1 w5 w9 w2 w33", "w7 w8", "w40 w41 w42 w43 w44 w45 w46", "w3"], max_length=16)
    section = AttributionSection(n_steps="auto", tolerance=1e-2, use_amp=False, compile="off")
    # bf16 steps with the fallback, as a GPU run has them (the CPU's full precision is fp32)
    settings = Settings.resolve(section, adapter, torch.device("cpu"), samples=4).with_ig(
        precision="bf16", cast_weights=True, full_precision_fallback=True
    )
    return adapter, tokens, settings


@pytest.mark.parametrize("ratio", [0.2, 5.0])
def test_a_batch_runs_as_a_batch_of_the_chosen_precision(case, ratio: float) -> None:
    adapter, tokens, settings = case
    start = StartPrecision("bf16", "fp32", ratio=ratio)
    chosen = attribute_batch(adapter, tokens, settings, settings.planner(), start=start)
    reduced = ratio < GAIN
    alone = settings if reduced else settings.started_in("fp32")
    assert alone.ig.precision == ("bf16" if reduced else "fp32") and alone.ig.cast_weights == reduced
    plain = attribute_batch(adapter, tokens, alone, alone.planner())
    torch.testing.assert_close(chosen["token_scores"], plain["token_scores"], rtol=0, atol=0)
    assert torch.equal(chosen["steps"], plain["steps"])
    if reduced:
        assert torch.equal(chosen["fallback"], plain["fallback"]) and start.counts["reduced"] == 4
    else:
        assert chosen["fallback"].tolist() == [SPEED] * 4 and start.counts["full"] == 4


def test_the_first_batch_measures_both_precisions_on_its_own_rows(case) -> None:
    adapter, tokens, settings = case
    start = StartPrecision("bf16", "fp32")
    attribute_batch(adapter, tokens, settings, settings.planner(), start=start)
    assert start.ratio is not None and start.ratio > 0
    assert sum(start.counts.values()) - start.counts["routed"] - start.counts["fell_back"] == 4


def overflowing(reduced: float) -> tuple[list[str], object]:
    """Timings where fp16's steps overflow (a trained language model's logits) and bf16's take `reduced`."""
    calls: list[str] = []

    def timed(precision: str) -> float:
        calls.append(precision)
        if precision == "fp16":
            raise NonFiniteGradients("the gradients along the path are not finite in fp16")
        return reduced if precision == "bf16" else 1.0

    return calls, timed


def test_fp16_overflowing_in_the_probe_moves_the_run_to_bf16_or_to_full_precision() -> None:
    start = StartPrecision("fp16", "tf32")
    calls, timed = overflowing(0.5)
    assert start.choose(timed) and (start.reduced, start.overflowed, start.ratio) == ("bf16", "fp16", 0.5)
    assert calls[0] == "fp16" and "fp16" not in calls[1:]
    assert start.describe().startswith("steps start in bf16: fp16 overflowed in the probe; the same")
    assert start.record()["precisions"] == ["bf16", "tf32"] and start.record()["overflowed"] == "fp16"
    without = StartPrecision("fp16", "tf32", bf16=False)  # a GPU without bf16
    assert not without.choose(overflowing(0.5)[1]) and not without.choose(overflowing(0.5)[1])
    assert without.describe() == "steps start in tf32: fp16 overflowed in the probe; the GPU has no bf16"
    assert without.record()["time_ratio"] is None and without.record()["expected_ratio"] is None


def test_bf16_steps_that_are_not_finite_are_the_model_s_and_stop_the_run() -> None:
    def timed(precision: str) -> float:
        raise NonFiniteGradients(f"the gradients along the path are not finite in {precision}")

    with pytest.raises(NonFiniteGradients):
        StartPrecision("bf16", "tf32").choose(timed)
