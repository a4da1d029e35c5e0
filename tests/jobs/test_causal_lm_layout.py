"""A causal LM's [prompt | completion] runs with each row's real tokens first and its padding last, with neither an
attention mask nor position ids (plain causal attention, and the model's own sliding windows): in float64 on tiny
random decoders of every family, with left- and right-padded prompts, the batch's losses equal those of each row run
alone through the model's own forward, and the fixed-length sequence torch.func.vmap runs gives the same losses and
gradients as the trimmed one."""

from __future__ import annotations

import pytest
import torch
import transformers
from lm_cases import FAMILIES, tiny_decoder, tiny_tokenizer
from test_causal_lm_output_positions import PAIRS, batch_of

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


def sliding_gemma2() -> torch.nn.Module:
    """A Gemma-2 whose sliding window (4 tokens) is shorter than the rows: its layers alternate windowed and full
    attention, which only the model's own masks get right."""
    config = transformers.Gemma2Config(
        vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, head_dim=8, sliding_window=4,
    )  # fmt: skip
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config).eval()


def each_row_alone(adapter: CausalLMAdapter) -> torch.Tensor:
    """Each pair's mean completion cross-entropy from the model's own forward of its unpadded token ids."""
    tok, out = adapter.tokenizer, []
    for prompt, completion in PAIRS:
        p, c = tok(prompt)["input_ids"], tok(completion, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logp = adapter.model(input_ids=torch.tensor([p + c])).logits[0].double().log_softmax(-1)
        out.append(-logp[len(p) - 1 : len(p) - 1 + len(c)].gather(1, torch.tensor(c)[:, None]).mean())
    return torch.stack(out)


def losses_and_grads(adapter: CausalLMAdapter, batch: dict[str, torch.Tensor], fixed: bool) -> list[torch.Tensor]:
    params = [p for p in adapter.model.parameters() if p.requires_grad]
    losses = adapter.completion_loss(batch, fixed_length=fixed)
    weights = torch.arange(1, len(losses) + 1, dtype=losses.dtype)  # each row's gradient counts apart
    return [losses.detach(), *torch.autograd.grad((losses * weights).sum(), params)]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", [*FAMILIES, "gemma2 (sliding window)"])
def test_the_batch_equals_each_row_alone_and_the_fixed_length_run(family: str, side: str) -> None:
    model = sliding_gemma2() if family.startswith("gemma2") else tiny_decoder(family)
    adapter = CausalLMAdapter(family, model.double(), tiny_tokenizer(), CPU)
    batch = batch_of(adapter, side)
    assert not batch["attention_mask"].all() and not batch["completion_mask"].all()  # padding in both parts
    trimmed, fixed = losses_and_grads(adapter, batch, fixed=False), losses_and_grads(adapter, batch, fixed=True)
    assert torch.allclose(trimmed[0], each_row_alone(adapter), rtol=1e-12, atol=0)
    assert torch.allclose(trimmed[0], fixed[0], rtol=1e-12, atol=0)
    for got, ref in zip(trimmed[1:], fixed[1:], strict=True):
        # Gemma's norms sum their weight's gradient in float32, in an order that follows the sequence's length
        assert torch.allclose(got, ref, rtol=1e-10, atol=1e-6 * float(ref.abs().max()))
    assert max(float(g.abs().max()) for g in trimmed[1:]) > 1e-3  # not a comparison of zeros
    layout = sequence_layout(batch["attention_mask"], batch["completion_mask"], trim=True)
    assert torch.equal(adapter.token_mask(batch), layout[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_sdpa_attention_gets_no_mask_but_the_causal_flag(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What lets a GPU pick the flash kernel: no mask tensor (padding last, no position ids, so transformers builds
    none, not even one for packed sequences), is_causal set."""
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
