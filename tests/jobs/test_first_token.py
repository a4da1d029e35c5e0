"""The last encoder layer computed for the first token only gives the full model's logits and gradients, is
used where the engines read logits only, and leaves models it does not fit alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from captum.attr import LayerIntegratedGradients
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertTokenizer,
    DistilBertConfig,
    DistilBertForSequenceClassification,
    ElectraConfig,
    ElectraForSequenceClassification,
    RobertaConfig,
    RobertaForSequenceClassification,
)

from gpuopt_tui.core.profiles.attribution import AttributionSection
from gpuopt_tui.jobs.attribution.baselines import baseline_embeddings
from gpuopt_tui.jobs.attribution.engine import Settings, attribute_batch
from gpuopt_tui.jobs.models import first_token
from gpuopt_tui.jobs.models.first_token import first_token_only
from gpuopt_tui.jobs.models.hf import SequenceClassifierAdapter

SIZES = {"vocab_size": 90, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64, "num_labels": 3}


def build(arch: str, attn: str = "sdpa", layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    common = {**SIZES, "num_hidden_layers": layers, "initializer_range": 0.3, "attn_implementation": attn}
    if arch == "bert":
        model = BertForSequenceClassification(BertConfig(**common))
    elif arch == "roberta":
        model = RobertaForSequenceClassification(RobertaConfig(**common, pad_token_id=1))
    elif arch == "electra":
        model = ElectraForSequenceClassification(ElectraConfig(**common, embedding_size=32))
    else:
        config = DistilBertConfig(vocab_size=90, dim=32, n_layers=2, n_heads=4, hidden_dim=64, num_labels=3)
        model = DistilBertForSequenceClassification(config)
    return model.eval().double()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(5, 90, (4, 11), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[3, 3:] = 0
    return ids, mask


def logits_and_input_gradients(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = batch()
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    logits = model(inputs_embeds=embeds, attention_mask=mask).logits
    (grads,) = torch.autograd.grad(logits[:, 1].sum() + logits[:, 2].square().sum(), embeds)
    return logits.detach(), grads


@pytest.mark.parametrize(
    ("arch", "attn"), [("bert", "sdpa"), ("bert", "eager"), ("roberta", "sdpa"), ("electra", "sdpa")]
)
def test_same_logits_and_gradients_as_the_full_model(arch: str, attn: str) -> None:
    model = build(arch, attn)
    last = model.base_model.encoder.layer[-1]
    widths = []
    hook = last.intermediate.register_forward_hook(lambda m, args, out: widths.append(args[0].shape[1]))
    full_logits, full_grads = logits_and_input_gradients(model)
    with first_token_only(model) as applied:
        logits, grads = logits_and_input_gradients(model)
    hook.remove()
    assert applied
    # the feed-forward block ran for all positions, then (after the check on 9 tokens) for the first one only
    assert widths[0] == 11 and widths[-1] == 1
    assert "forward" not in vars(model.base_model)  # the model's own forward is back
    torch.testing.assert_close(logits, full_logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads, full_grads, rtol=1e-10, atol=1e-12)
    assert full_grads[:, 1:].abs().max() > 0.01  # other positions do matter, through keys and values


def test_models_that_do_not_fit_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    distil = build("distilbert")
    with first_token_only(distil) as applied:
        assert not applied

    class Custom(BertForSequenceClassification):  # a head that might read other positions
        pass

    custom = Custom(BertConfig(**SIZES)).eval()
    with first_token_only(custom) as applied:
        assert not applied

    monkeypatch.setattr(first_token, "CHECK_TOLERANCE", -1.0)  # the logits check fails
    bert = build("bert")
    with first_token_only(bert) as applied:
        assert not applied
        assert "forward" not in vars(bert.bert)


def test_nested_blocks_restore_once() -> None:
    model = build("bert")
    with first_token_only(model):
        with first_token_only(model) as inner:
            assert inner
        assert "forward" in vars(model.bert)  # still lean: the outer block owns the swap
    assert "forward" not in vars(model.bert)


def test_engine_with_the_pruned_layer_equals_captum_layer_ig() -> None:
    """IG through the adapter (which prunes the last layer) = Captum's layer IG on the full model."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(85)]
    tokenizer = BertTokenizer(vocab={t: i for i, t in enumerate(vocab)})
    model = build("bert", layers=3)
    adapter = SequenceClassifierAdapter("tiny-bert", model, tokenizer, 3, torch.device("cpu"))
    tokens = adapter.tokenize(["w1 w5 w9 w2 w33", "w7 w8", "w40 w41 w42 w43 w44 w45 w46"], max_length=16)
    section = AttributionSection(n_steps=12, method="gausslegendre", baseline="pad", use_amp=False, compile="off")
    settings = Settings.resolve(section, adapter, torch.device("cpu"), samples=3)
    calls = []
    real = first_token.encoder_layer

    def spy(layer, hidden, mask, *, first_only):
        calls.append(first_only)
        return real(layer, hidden, mask, first_only=first_only)

    first_token.encoder_layer = spy
    try:
        ours = attribute_batch(adapter, tokens, settings, settings.planner())
    finally:
        first_token.encoder_layer = real
    assert calls.count(True) and calls.count(False) == 2 * calls.count(True)  # the lean forward really ran

    ids, mask = tokens["input_ids"], tokens["attention_mask"]
    with torch.no_grad():
        emb = adapter.word_embeddings()(ids)
    base = baseline_embeddings(adapter, ids, mask, emb, tokenizer.pad_token_id)
    structure = (ids == tokenizer.cls_token_id) | (ids == tokenizer.sep_token_id) | (mask == 0)
    baseline_ids = torch.where(structure, ids, tokenizer.pad_token_id)
    assert torch.equal(base, adapter.word_embeddings()(baseline_ids))
    lig = LayerIntegratedGradients(
        lambda i, m: model(input_ids=i, attention_mask=m).logits, model.bert.embeddings.word_embeddings
    )
    theirs = lig.attribute(
        ids, baseline_ids, target=ours["target"], additional_forward_args=(mask,), n_steps=12, method="gausslegendre"
    )
    scores = theirs.sum(-1)
    assert scores.abs().max() > 0.1
    assert float((ours["token_scores"] - scores).abs().max() / scores.abs().max()) < 1e-5


def test_batches_without_padding_run_unmasked_with_the_same_result() -> None:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(85)]
    tokenizer = BertTokenizer(vocab={t: i for i, t in enumerate(vocab)})
    adapter = SequenceClassifierAdapter("tiny-bert", build("bert"), tokenizer, 3, torch.device("cpu"))
    tokens = adapter.tokenize(["w1 w5 w9", "w7 w8 w3"], max_length=16)  # same length: no padding
    mask = tokens["attention_mask"]
    assert adapter.step_mask(mask) is None
    padded = mask.clone()
    padded[0, -1] = 0
    assert adapter.step_mask(padded) is padded

    section = AttributionSection(n_steps=8, use_amp=False, compile="off")
    settings = Settings.resolve(section, adapter, torch.device("cpu"), samples=2)
    lean = attribute_batch(adapter, tokens, settings, settings.planner())
    reference = dataclasses.replace(settings, optimized=False)  # the model's own forward, one step at a time
    full = attribute_batch(adapter, tokens, reference, reference.planner())
    torch.testing.assert_close(lean["token_scores"], full["token_scores"], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(lean["deltas"], full["deltas"], rtol=1e-9, atol=1e-12)
