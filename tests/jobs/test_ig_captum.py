"""The batched engine against Captum and against its own one-step-at-a-time reference, on tiny random
BERT, RoBERTa and DistilBERT classifiers (initializer_range=0.3 so that attributions are far from 0).

Relative error = max |ours - theirs| / max |theirs| over all attribution entries of the batch.
"""

from __future__ import annotations

import pytest
import torch
from captum.attr import IntegratedGradients, LayerIntegratedGradients
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertTokenizer,
    DistilBertConfig,
    DistilBertForSequenceClassification,
    RobertaConfig,
    RobertaForSequenceClassification,
)

from gpuopt_tui.core.profiles.attribution import AttributionSection
from gpuopt_tui.jobs.attribution import (
    METHODS,
    ChunkPlanner,
    IGOptions,
    integrated_gradients,
    integrated_gradients_reference,
)
from gpuopt_tui.jobs.attribution.baselines import baseline_embeddings
from gpuopt_tui.jobs.attribution.engine import Settings, attribute_batch
from gpuopt_tui.jobs.models.hf import SequenceClassifierAdapter

N_STEPS = 16
SIZES = {"vocab_size": 100, "max_position_embeddings": 66, "initializer_range": 0.3, "num_labels": 3}


def build(arch: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "bert":
        config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, **SIZES)
        model = BertForSequenceClassification(config)
    elif arch == "roberta":
        config = RobertaConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, pad_token_id=1, **SIZES
        )
        model = RobertaForSequenceClassification(config)
    else:
        config = DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64, **SIZES)
        model = DistilBertForSequenceClassification(config)
    return model.eval().to(dtype)


@pytest.fixture(scope="module", params=["bert", "roberta", "distilbert"])
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


def inputs(model: torch.nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Embeddings of 4 random token sequences (two of them padded), a [PAD]-embedding baseline, the mask."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 100, (4, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[3, 5:] = 0
    table = model.get_input_embeddings()
    with torch.no_grad():
        emb = table(ids).to(dtype)
        base = table(torch.zeros_like(ids)).to(dtype)
    return emb, base, mask


def forward_of(model: torch.nn.Module):
    return lambda embeds, mask, context: model(inputs_embeds=embeds, attention_mask=mask).logits


def rel_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("method", [m for m in METHODS if m != "clenshaw_curtis"])  # not in Captum
def test_equals_captum_integrated_gradients(arch: str, method: str, dtype: torch.dtype) -> None:
    model = build(arch, dtype)
    emb, base, mask = inputs(model, dtype)
    ours = integrated_gradients(
        forward_of(model), emb, base, mask, options=IGOptions(n_steps=N_STEPS, method=method, alpha_batch_size=5)
    )
    ig = IntegratedGradients(lambda e, m: model(inputs_embeds=e, attention_mask=m).logits)
    theirs, captum_delta = ig.attribute(
        emb,
        base,
        target=ours.target,
        additional_forward_args=(mask,),
        n_steps=N_STEPS,
        method=method,
        return_convergence_delta=True,
    )
    if method == "riemann_trapezoid":  # same points; Captum weighs them 1/n, we weigh 1/(n-1)
        theirs = theirs * N_STEPS / (N_STEPS - 1)
    else:
        assert torch.allclose(ours.deltas, captum_delta.to(ours.deltas.dtype), rtol=0, atol=1e-5)
    assert theirs.abs().max() > 0.1  # attributions are far from zero, so the relative error means something
    assert ours.attributions.dtype == dtype
    assert rel_error(ours.attributions, theirs) < 1e-5


def test_inputs_embeds_equals_layer_ig_on_word_embeddings() -> None:
    """IG over inputs_embeds with a [PAD] baseline that keeps [CLS]/[SEP] = Captum's layer IG on the word
    embeddings with the same baseline token ids."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(60)]
    tokenizer = BertTokenizer(vocab={t: i for i, t in enumerate(vocab)})
    model = build("bert")
    adapter = SequenceClassifierAdapter("tiny-bert", model, tokenizer, 3, torch.device("cpu"))
    batch = adapter.tokenize(["w1 w5 w9 w2 w33", "w7 w8", "w40 w41 w42 w43 w44 w45 w46"], max_length=16)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        emb = adapter.word_embeddings()(ids)
    base = baseline_embeddings(adapter, ids, mask, emb, tokenizer.pad_token_id)
    ours = integrated_gradients(adapter.logits_from_embeds, emb, base, mask, options=IGOptions(n_steps=N_STEPS))

    structure = (ids == tokenizer.cls_token_id) | (ids == tokenizer.sep_token_id) | (mask == 0)
    baseline_ids = torch.where(structure, ids, tokenizer.pad_token_id)
    lig = LayerIntegratedGradients(
        lambda i, m: model(input_ids=i, attention_mask=m).logits, model.bert.embeddings.word_embeddings
    )
    theirs = lig.attribute(ids, baseline_ids, target=ours.target, additional_forward_args=(mask,), n_steps=N_STEPS)
    assert theirs.abs().max() > 0.1
    assert rel_error(ours.attributions, theirs) < 1e-5
    assert (ours.token_scores()[structure] == 0).all()  # kept in the baseline: exactly zero attribution


def test_zero_all_baseline_equals_layer_ig_with_captums_zero_baseline() -> None:
    """baseline = "zero-all" (zero vectors at [CLS]/[SEP] too) = Captum's layer IG on the word embeddings with a
    zero baseline (token id 0 everywhere, whose embedding row is zero: [PAD] is BERT's padding_idx)."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(60)]
    tokenizer = BertTokenizer(vocab={t: i for i, t in enumerate(vocab)})
    model = build("bert")
    assert not model.bert.embeddings.word_embeddings.weight[0].any()
    adapter = SequenceClassifierAdapter("tiny-bert", model, tokenizer, 3, torch.device("cpu"))
    settings = Settings.resolve(
        AttributionSection(n_steps=N_STEPS, baseline="zero-all"), adapter, torch.device("cpu"), 3
    ).with_ig(alpha_batch_size=5)
    batch = adapter.tokenize(["w1 w5 w9 w2 w33", "w7 w8", "w40 w41 w42 w43 w44 w45 w46"], max_length=16)
    ours = attribute_batch(adapter, batch, settings, settings.planner())

    ids, mask = batch["input_ids"], batch["attention_mask"]
    lig = LayerIntegratedGradients(
        lambda i, m: model(input_ids=i, attention_mask=m).logits, model.bert.embeddings.word_embeddings
    )
    theirs = lig.attribute(
        ids, torch.zeros_like(ids), target=ours["target"], additional_forward_args=(mask,), n_steps=N_STEPS
    ).sum(-1)
    assert rel_error(ours["token_scores"].double(), theirs) < 1e-5
    structure = (ids == tokenizer.cls_token_id) | (ids == tokenizer.sep_token_id)
    assert (ours["token_scores"][structure].abs() > 1e-3).all()  # the structure tokens are attributed too


def test_reference_path_equals_batched_path(arch: str) -> None:
    model = build(arch)
    emb, base, mask = inputs(model, torch.float64)
    target = torch.tensor([0, 2, 1, 2])
    args = (forward_of(model), emb, base, mask, target)
    batched = integrated_gradients(
        *args, options=IGOptions(n_steps=N_STEPS, method="riemann_middle", alpha_batch_size=6)
    )
    calls = []
    reference = integrated_gradients_reference(
        *args, options=IGOptions(n_steps=N_STEPS, method="riemann_middle"), on_step=lambda d, t: calls.append((d, t))
    )
    assert calls == [(d, 4 * N_STEPS) for d in range(1, 4 * N_STEPS + 1)]
    assert rel_error(batched.attributions, reference.attributions) < 1e-10
    assert torch.allclose(batched.deltas, reference.deltas, rtol=0, atol=1e-10)
    assert torch.equal(batched.target, target)


@pytest.mark.parametrize("alpha_batch_size", [1, 3, 7, "auto"])
def test_chunked_equals_unchunked(alpha_batch_size: int | str) -> None:
    model = build("bert")
    emb, base, mask = inputs(model, torch.float64)
    chunks = []
    whole = integrated_gradients(
        forward_of(model), emb, base, mask, options=IGOptions(n_steps=N_STEPS, alpha_batch_size=None)
    )
    chunked = integrated_gradients(
        forward_of(model),
        emb,
        base,
        mask,
        options=IGOptions(n_steps=N_STEPS, alpha_batch_size=alpha_batch_size),
        on_chunk=lambda done, total: chunks.append(done),
    )
    assert chunks[-1] == N_STEPS
    if isinstance(alpha_batch_size, int):
        assert len(chunks) == -(-N_STEPS // alpha_batch_size)
    assert rel_error(chunked.attributions, whole.attributions) < 1e-12


def test_bucketed_equals_padded(arch: str) -> None:
    """Trimming a batch's padding (as length bucketing does) leaves the real tokens' attributions unchanged."""
    model = build(arch)
    emb, base, mask = inputs(model, torch.float64)
    base = torch.where(mask.unsqueeze(-1).bool(), base, emb)  # padding kept in the baseline, as the job does
    padded = integrated_gradients(forward_of(model), emb, base, mask, options=IGOptions(n_steps=N_STEPS))
    assert (padded.token_scores()[mask == 0] == 0).all()
    short = [3]  # the sample with 5 real tokens, alone in a bucket of length 5
    long = [0, 1, 2]  # the others, trimmed to their longest (12)
    for rows, length in ((short, 5), (long, 12)):
        part = integrated_gradients(
            forward_of(model),
            emb[rows, :length],
            base[rows, :length],
            mask[rows, :length],
            options=IGOptions(n_steps=N_STEPS),
        )
        assert rel_error(part.token_scores(), padded.token_scores()[rows, :length]) < 1e-10
        assert torch.allclose(part.deltas, padded.deltas[rows], rtol=0, atol=1e-10)


def test_parameters_are_frozen_during_the_run_and_restored() -> None:
    model = build("bert")
    emb, base, mask = inputs(model, torch.float64)
    model.classifier.bias.requires_grad_(False)  # a mixed state to restore
    seen = []

    def forward(embeds, m, context):
        seen.append(any(p.requires_grad for p in model.parameters()))
        return model(inputs_embeds=embeds, attention_mask=m).logits

    integrated_gradients(forward, emb, base, mask, options=IGOptions(n_steps=4), model=model)
    assert seen and not any(seen)
    assert not model.classifier.bias.requires_grad
    assert all(p.requires_grad for n, p in model.named_parameters() if n != "classifier.bias")
    assert all(p.grad is None for p in model.parameters())


def test_out_of_memory_halves_the_chunk_and_loses_nothing() -> None:
    model = build("bert")
    emb, base, mask = inputs(model, torch.float64)
    rows_seen = []

    def forward(embeds, m, context):
        rows_seen.append(embeds.shape[0])
        if embeds.shape[0] > 3 * 4:  # "out of memory" above 3 steps of the 4 samples
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return model(inputs_embeds=embeds, attention_mask=m).logits

    events = []
    planner = ChunkPlanner(12, on_event=lambda type, **fields: events.append((type, fields["retry_steps"])))
    result = integrated_gradients(
        forward, emb, base, mask, options=IGOptions(n_steps=N_STEPS), planner=planner, model=model
    )
    expected = integrated_gradients(forward_of(model), emb, base, mask, options=IGOptions(n_steps=N_STEPS))
    assert events == [("oom_retry", 4), ("oom_retry", 2)]  # 8 steps (balanced 12) -> 4 -> 2
    assert rows_seen[:3] == [8, 32, 16] and set(rows_seen[3:]) == {8}  # endpoints, 2 failures, then 2 steps
    assert rel_error(result.attributions, expected.attributions) < 1e-12
    with pytest.raises(torch.OutOfMemoryError):  # even one step too large: the error reaches the caller
        integrated_gradients(
            lambda *a: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory")),
            emb,
            base,
            mask,
            options=IGOptions(n_steps=4, alpha_batch_size=1),
            model=model,
        )


def test_bf16_autocast_is_applied_to_the_steps_only() -> None:
    model = build("bert", torch.float32)
    emb, base, mask = inputs(model, torch.float32)
    fp32 = integrated_gradients(
        forward_of(model), emb, base, mask, options=IGOptions(n_steps=N_STEPS, precision="fp32")
    )
    bf16 = integrated_gradients(
        forward_of(model), emb, base, mask, options=IGOptions(n_steps=N_STEPS, precision="bf16")
    )
    error = rel_error(bf16.attributions, fp32.attributions)
    assert 1e-4 < error < 0.1  # bf16 really ran (8-bit mantissa), and stays close
    assert bf16.attributions.dtype == torch.float32
    assert torch.equal(bf16.scores, fp32.scores)  # F(x), F(baseline) and the deltas stay in full precision
    assert torch.equal(bf16.baseline_scores, fp32.baseline_scores)
