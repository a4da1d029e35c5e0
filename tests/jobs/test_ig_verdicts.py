"""n_steps = "auto" reports a sample within its tolerance only when it is: on tiny random classifiers of six
families (DistilBERT's head has a ReLU: its integrands jump), in float64 against a fine reference; the precision
chain and its measured-rounding probe; the audit's verdict and words."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from gpuopt_tui.jobs.attribution import IGOptions, integrated_gradients
from gpuopt_tui.jobs.attribution.adaptive import precision_chain, probe_rounding
from gpuopt_tui.jobs.attribution.audit import audit_count, audit_outcome, audit_warning, chosen_samples
from gpuopt_tui.jobs.attribution.check import relative_difference

TOLERANCE = 1e-3
SIZE = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64}


def classifier(family: str) -> torch.nn.Module:
    common = {"vocab_size": 100, "num_labels": 2, "initializer_range": 0.3, "pad_token_id": 0}
    if family == "distilbert":
        config = transformers.DistilBertConfig(n_layers=2, dim=32, n_heads=4, hidden_dim=64, **common)
    elif family == "albert":
        config = transformers.AlbertConfig(embedding_size=16, **SIZE, **common)
    elif family == "deberta-v2":
        config = transformers.DebertaV2Config(relative_attention=True, pos_att_type=["p2c", "c2p"], **SIZE, **common)
    else:
        classes = {"bert": transformers.BertConfig, "roberta": transformers.RobertaConfig}
        config = {**classes, "electra": transformers.ElectraConfig}[family](**SIZE, **common)
    torch.manual_seed(0)
    return transformers.AutoModelForSequenceClassification.from_config(config).eval().double()


def inputs(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(5, 100, (6, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[2, 6:] = 0
    ids = ids * mask
    return model.get_input_embeddings()(ids).detach(), mask


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert", "electra", "albert", "deberta-v2"])
def test_no_sample_is_reported_within_a_tolerance_it_misses(family: str) -> None:
    model = classifier(family)
    emb, mask = inputs(model)

    def forward(e, m, c):
        return model(inputs_embeds=e, attention_mask=m).logits

    base = torch.zeros_like(emb)
    auto = integrated_gradients(
        forward, emb, base, mask, options=IGOptions(n_steps="auto", tolerance=TOLERANCE, per_dimension=False)
    )
    fine = integrated_gradients(
        forward,
        emb,
        base,
        mask,
        auto.target,
        IGOptions(n_steps="auto", tolerance=1e-7, max_steps=8193, per_dimension=False),
    )
    assert bool(fine.within.all())  # the reference is itself within its (much tighter) tolerance
    error = relative_difference(auto.token_scores(), fine.token_scores())
    assert bool((error[auto.within] <= TOLERANCE).all()), (error, auto.within)
    # the verdict is exactly what the two figures the results write say
    written = (auto.relative_deltas() <= TOLERANCE) & (auto.error <= TOLERANCE)
    assert torch.equal(auto.within, written)


def test_the_precision_chain_ends_in_fp32() -> None:
    assert precision_chain("fp16", 1e-2) == ["fp16", "tf32", "fp32"]
    assert precision_chain("bf16", 1e-4) == ["bf16", "fp32"]
    assert precision_chain("tf32", 1e-2) == ["tf32", "fp32"]
    assert precision_chain("fp32", 1e-2) == ["fp32"]


def test_measured_rounding_is_the_spread_against_full_precision() -> None:
    full = torch.tensor([[1.0, -1.0], [2.0, 0.0]]).double().numpy()
    low = full + torch.tensor([[0.01, 0.01], [0.0, 0.0]]).double().numpy()
    assert probe_rounding(low, full) == pytest.approx(0.01)
    assert probe_rounding(full, full) == 0.0


def test_samples_whose_low_precision_is_noisy_move_after_their_first_pass() -> None:
    """A forward whose bf16 steps carry a wobble that fp32 has not: the probe measures it on every sample, which
    starts over in full precision (fp32 on the CPU) and gives what a run in fp32 alone gives."""
    model = classifier("bert")
    emb, mask = inputs(model)
    emb, model = emb.float(), model.float()

    def forward(e, m, c):
        out = model(inputs_embeds=e, attention_mask=m).logits
        if e.dtype == torch.bfloat16:  # rounding the probe must see: 3% of the output, varying along the path
            out = out * (1 + 0.03 * torch.sin(40 * e.float().sum((1, 2))))[:, None]
        return out

    base = torch.zeros_like(emb)
    common = IGOptions(n_steps="auto", tolerance=5e-2, per_dimension=False)
    bf16 = dataclasses.replace(common, precision="bf16", cast_weights=True, full_precision_fallback=True)
    mixed = integrated_gradients(forward, emb, base, mask, options=bf16, model=model)
    assert bool(mixed.full_precision.all()) and set(mixed.fallback.tolist()) <= {1, 2}
    assert 2 in mixed.fallback.tolist()  # some moved by the measured rounding, not by the output change alone
    alone = integrated_gradients(forward, emb, base, mask, mixed.target, common, model=model)
    torch.testing.assert_close(mixed.token_scores(), alone.token_scores(), rtol=0, atol=1e-6)
    assert torch.equal(mixed.within, alone.within)


def test_the_audit_names_its_samples_and_says_when_they_miss() -> None:
    assert audit_count("auto", torch.device("cpu")) == 2 and audit_count(0, torch.device("cpu")) == 0
    assert chosen_samples(100, 4) == chosen_samples(100, 4) == sorted(chosen_samples(100, 4))
    assert chosen_samples(3, 4) == [0, 1, 2]
    samples = [{"index": 7, "error": 3e-3, "within": False}, {"index": 9, "error": 1e-4, "within": True}]
    result = {"samples": samples, "max_error": 3e-3, "tolerance": 1e-3, "above": 1, "silent_misses": 1, "seconds": 1.5}
    warning = audit_warning(result)
    assert warning is not None and "1 of 2 audited samples" in warning and "#7 (3.0e-03)" in warning
    assert "the run reported within it" in warning and "use_amp = false" in warning
    flagged = audit_warning({**result, "silent_misses": 0})
    assert flagged is not None and "flags each of them" in flagged
    assert audit_outcome(result).startswith("1 of 2 samples within 0.001 (max error 3.0e-03")
    assert audit_warning({**result, "above": 0}) is None
