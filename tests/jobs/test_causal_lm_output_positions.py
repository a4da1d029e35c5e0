"""A causal LM's output layer runs on the positions that predict a completion token only: the completion loss, its
gradients (every parameter, the output layer's own included, tied or not, and LoRA adapters) and the attributed
log-probability equal those of the whole sequence's logits, in float64 on tiny random decoders, with left and right
padding and completions of several lengths."""

from __future__ import annotations

import pytest
import torch
from lm_cases import FAMILIES, tiny_decoder, tiny_tokenizer
from test_tracin_causal_lm import dataset

from gpuopt_tui.jobs.models.causal_lm import CausalLMAdapter

CPU = torch.device("cpu")
PAIRS = [  # completions of 1 to 6 tokens after prompts of 2 to 8
    ("the cat sat on the", "big red mat"),
    ("a dog", "ran"),
    ("the small blue dog ran under the", "rug"),
    ("a happy cat", "sat on the mat and ran"),
    ("the red", "dog ran on the big rug"),
]


def batch_of(adapter: CausalLMAdapter, side: str) -> dict[str, torch.Tensor]:
    return dataset(adapter, PAIRS, side).tensors


def head_widths(head: torch.nn.Module, run) -> tuple[object, list[int]]:
    """run()'s result, and the number of positions the output layer `head` saw in each of its calls."""
    widths: list[int] = []
    handle = head.register_forward_hook(lambda module, args, out: widths.append(args[0].shape[1]))
    try:
        return run(), widths
    finally:
        handle.remove()


def with_whole_sequence_logits(adapter: CausalLMAdapter, run, monkeypatch: pytest.MonkeyPatch) -> object:
    """run() with the output layer out of the adapter's sight: the model computes every position's logits."""
    with monkeypatch.context() as patch:
        patch.setattr(adapter.model, "get_output_embeddings", lambda: None)
        return run()


def loss_and_grads(adapter: CausalLMAdapter, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list]:
    params = [p for p in adapter.model.parameters() if p.requires_grad]
    losses = adapter.loss_per_example(batch)
    weights = torch.arange(1, len(losses) + 1, dtype=losses.dtype)  # each row's gradient counts apart
    return losses.detach(), list(torch.autograd.grad((losses * weights).sum(), params))


def assert_same(adapter: CausalLMAdapter, batch: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> None:
    head = adapter.model.get_output_embeddings()
    (loss, grads), widths = head_widths(head, lambda: loss_and_grads(adapter, batch))
    completion = batch["completion_ids"].shape[1]
    assert widths == [completion + 1]  # the completion's positions and the one after it, not the whole sequence
    (whole_loss, whole_grads), whole_widths = with_whole_sequence_logits(
        adapter, lambda: head_widths(head, lambda: loss_and_grads(adapter, batch)), monkeypatch
    )
    longest = int((batch["attention_mask"].sum(1) + batch["completion_mask"].sum(1)).max())
    assert whole_widths == [longest]  # the sequence trimmed to its longest row's real tokens
    assert torch.allclose(loss, whole_loss, rtol=1e-12, atol=0)
    assert len(grads) == len(whole_grads) > 0
    for g, ref in zip(grads, whole_grads):
        assert torch.allclose(g, ref, rtol=1e-10, atol=1e-14)
    assert max(float(g.abs().max()) for g in grads) > 1e-3  # not a comparison of zeros


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_parameter_gets_the_gradient_of_the_whole_sequences_logits(family, side, monkeypatch) -> None:
    adapter = CausalLMAdapter(family, tiny_decoder(family).double(), tiny_tokenizer(), CPU)
    assert_same(adapter, batch_of(adapter, side), monkeypatch)
    params = dict(adapter.model.named_parameters())
    head = adapter.model.get_output_embeddings().weight
    assert any(p is head for p in params.values())  # the output layer's own weight (tied or not) is compared


@pytest.mark.parametrize("side", ["right", "left"])
def test_an_untied_output_layer_gets_its_own_gradient(side, monkeypatch) -> None:
    model = tiny_decoder("llama").double()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() + 0.1)  # not the embedding's
    adapter = CausalLMAdapter("llama", model, tiny_tokenizer(), CPU)
    assert adapter.model.lm_head.weight is not adapter.model.model.embed_tokens.weight
    assert_same(adapter, batch_of(adapter, side), monkeypatch)


@pytest.mark.parametrize("side", ["right", "left"])
def test_lora_adapters_get_the_gradient_of_the_whole_sequences_logits(side, monkeypatch) -> None:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model = peft.get_peft_model(tiny_decoder("qwen2").double(), config).eval()
    adapter = CausalLMAdapter("qwen2", model, tiny_tokenizer(), CPU)
    assert_same(adapter, batch_of(adapter, side), monkeypatch)


def test_the_per_example_loss_under_vmap_equals_the_batched_loss(monkeypatch) -> None:
    """torch.func.vmap over single rows (the engine's vmap gradients) runs the gathered output layer too."""
    adapter = CausalLMAdapter("llama", tiny_decoder("llama").double(), tiny_tokenizer(), CPU)
    batch = batch_of(adapter, "left")
    params = {n: p.detach() for n, p in adapter.model.named_parameters()}

    def one(example: dict[str, torch.Tensor]) -> torch.Tensor:
        return adapter.functional_loss(params, {k: v[None] for k, v in example.items()})[0]

    vmapped, widths = head_widths(adapter.model.get_output_embeddings(), lambda: torch.func.vmap(one)(batch))
    assert widths == [batch["completion_ids"].shape[1] + 1]
    whole = with_whole_sequence_logits(adapter, lambda: adapter.loss_per_example(batch).detach(), monkeypatch)
    assert torch.allclose(vmapped, whole, rtol=1e-12, atol=0)


def test_the_attributed_log_probability_is_that_of_the_whole_sequences_logits(monkeypatch) -> None:
    adapter = CausalLMAdapter("gemma", tiny_decoder("gemma").double(), tiny_tokenizer(), CPU)
    batch = batch_of(adapter, "left")
    got = adapter.logits(batch)
    whole = with_whole_sequence_logits(adapter, lambda: adapter.logits(batch), monkeypatch)
    assert torch.allclose(got, whole, rtol=1e-12, atol=0)
