"""A causal LM's [prompt | completion] runs with each row's real tokens first and its padding last, without an
attention mask (plain causal attention): the loss and its gradients equal those of the same forward given the
padding mask, in float64 on tiny random decoders of every family, with left- and right-padded prompts."""

from __future__ import annotations

import pytest
import torch
from lm_cases import FAMILIES, tiny_decoder, tiny_tokenizer
from test_causal_lm_output_positions import batch_of

from gpuopt_tui.jobs.models.causal_lm import CausalLMAdapter, sequence_layout

CPU = torch.device("cpu")


def test_the_layout_moves_padding_last_and_finds_the_predicting_positions() -> None:
    prompt = torch.tensor([[0, 1, 1], [1, 1, 0]])  # left- and right-padded prompts
    completion = torch.tensor([[1, 0], [1, 1]])
    order, mask, before = sequence_layout(prompt, completion, trim=False)
    assert order.tolist() == [[1, 2, 3, 0, 4], [0, 1, 3, 4, 2]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]
    # the last prompt token predicts the first completion token; a padded slot repeats the last real position
    assert before.tolist() == [[1, 2, 2], [1, 2, 3]]
    trimmed = sequence_layout(prompt, completion, trim=True)  # no row is longer than 4 real tokens
    assert trimmed[0].tolist() == [[1, 2, 3, 0], [0, 1, 3, 4]]
    assert trimmed[1].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]] and torch.equal(trimmed[2], before)


def attention_masks_seen(adapter: CausalLMAdapter, run) -> tuple[object, list[object]]:
    seen: list[object] = []
    handle = adapter.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("attention_mask")), with_kwargs=True
    )
    try:
        return run(), seen
    finally:
        handle.remove()


def losses_and_grads(adapter: CausalLMAdapter, batch: dict[str, torch.Tensor], masked: bool) -> list[torch.Tensor]:
    params = [p for p in adapter.model.parameters() if p.requires_grad]
    losses = adapter.completion_loss(batch, prepared_mask=masked)
    weights = torch.arange(1, len(losses) + 1, dtype=losses.dtype)  # each row's gradient counts apart
    return [losses.detach(), *torch.autograd.grad((losses * weights).sum(), params)]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_unmasked_forward_equals_the_masked_one(family: str, side: str) -> None:
    adapter = CausalLMAdapter(family, tiny_decoder(family).double(), tiny_tokenizer(), CPU)
    batch = batch_of(adapter, side)
    assert not batch["attention_mask"].all() and not batch["completion_mask"].all()  # padding in both parts
    unmasked, seen = attention_masks_seen(adapter, lambda: losses_and_grads(adapter, batch, masked=False))
    assert seen == [None]
    masked, seen = attention_masks_seen(adapter, lambda: losses_and_grads(adapter, batch, masked=True))
    assert seen[0] is not None
    assert torch.allclose(unmasked[0], masked[0], rtol=1e-12, atol=0)  # the losses
    for got, ref in zip(unmasked[1:], masked[1:], strict=True):
        # Gemma's norms sum their weight's gradient in float32, in an order that follows the sequence's length
        assert torch.allclose(got, ref, rtol=1e-10, atol=1e-6 * float(ref.abs().max()))
    assert max(float(g.abs().max()) for g in unmasked[1:]) > 1e-3  # not a comparison of zeros
    layout = sequence_layout(batch["attention_mask"], batch["completion_mask"], trim=True)
    assert torch.equal(adapter.token_mask(batch), layout[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_sdpa_attention_gets_no_mask_but_the_causal_flag(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What lets a GPU pick the flash kernel: no mask tensor (padding last, positions counting on through it, so
    transformers builds none, not even one for packed sequences), is_causal set."""
    model = tiny_decoder(family)
    model.config._attn_implementation = "sdpa"
    adapter = CausalLMAdapter(family, model, tiny_tokenizer(), CPU)
    calls: list[tuple[bool, bool]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        calls.append((mask is None, bool(kwargs.get("is_causal"))))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    adapter.loss_per_example(batch_of(adapter, "left"))
    assert calls and set(calls) == {(True, True)}
