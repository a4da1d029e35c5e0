"""Causal LM attribution (prompt -> completion log-probability) on tiny random decoders of seven families, in
float64, against Captum's LayerIntegratedGradients on each sample alone (unpadded) and against a plain forward.
Slow: some ten minutes on a busy 2-core machine.

Relative error = max |ours - theirs| / max |theirs| over the batch's prompt-token scores.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from captum.attr import LayerIntegratedGradients
from lm_cases import BOS, EOS, FAMILIES, PAD, tiny_decoder, tiny_tokenizer

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.attribution import AttributionSection
from gpuopt_tui.jobs.attribution.engine import Settings, attribute_batch
from gpuopt_tui.jobs.completion_data import per_token_rows
from gpuopt_tui.jobs.data import TextDataset
from gpuopt_tui.jobs.models.causal_lm import CausalLMAdapter

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")
N_STEPS = 12
PAIRS = [  # prompts of different lengths, multi-token completions of different lengths
    ("the cat sat on the", "big red mat"),
    ("a dog", "ran"),
    ("the quick blue river and the sun", "sleeps under the hill"),
]


@pytest.fixture(scope="module", params=FAMILIES)
def adapter(request: pytest.FixtureRequest) -> CausalLMAdapter:
    return CausalLMAdapter(request.param, tiny_decoder(request.param).double(), tiny_tokenizer(), CPU)


def batch_of(adapter: CausalLMAdapter, side: str = "right", per_token: bool = False) -> dict[str, torch.Tensor]:
    tensors = adapter.tokenize([p for p, _ in PAIRS], 32) | adapter.completions([c for _, c in PAIRS], 32)
    tensors["target_position"] = torch.full((len(PAIRS),), -1)
    if per_token:
        ds = TextDataset(tensors, [p for p, _ in PAIRS], adapter.token_fields, "test", {"completions": []})
        tensors = per_token_rows(ds).tensors
    if side == "left":
        tensors["input_ids"], tensors["attention_mask"] = left_padded(tensors["input_ids"], tensors["attention_mask"])
    return tensors


def left_padded(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows with their padding moved to the left (a stable sort of the mask keeps the tokens in order)."""
    order = mask.sort(dim=1, stable=True).indices
    return ids.gather(1, order), mask.gather(1, order)


def settings_of(adapter: CausalLMAdapter, **changes: object) -> Settings:
    section = AttributionSection(n_steps=N_STEPS, method="gausslegendre", baseline="pad", alpha_batch_size=5)
    section = dataclasses.replace(section, **changes)
    return Settings.resolve(section, adapter, CPU, len(PAIRS))


def captum_scores(adapter: CausalLMAdapter, prompt: str, completion: str, token: int | None) -> torch.Tensor:
    """Per prompt token: LayerIntegratedGradients on the input embeddings of prompt + completion alone, the
    baseline ids = the pad id at the prompt's content positions (BOS and the completion kept), explaining the
    completion's log-probability (`token`: that completion token's alone)."""
    model, tok = adapter.model, adapter.tokenizer
    prompt_ids = tok(prompt)["input_ids"]
    completion_ids = tok(completion, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids + completion_ids])
    base = ids.clone()
    base[0, 1 : len(prompt_ids)] = PAD
    first = len(prompt_ids) - 1  # the position predicting the completion's first token

    def log_prob(input_ids: torch.Tensor) -> torch.Tensor:
        logp = model(input_ids=input_ids).logits.log_softmax(-1)
        chosen = logp[:, first : first + len(completion_ids)].gather(
            2, ids[:, len(prompt_ids) :, None].expand(input_ids.shape[0], -1, 1)
        )[..., 0]
        return chosen.sum(1) if token is None else chosen[:, token]

    lig = LayerIntegratedGradients(log_prob, model.get_input_embeddings())
    attributions = lig.attribute(ids, base, n_steps=N_STEPS, method="gausslegendre", internal_batch_size=N_STEPS)
    return attributions.sum(-1)[0, : len(prompt_ids)]


def rel_error(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    a, b = torch.cat(ours), torch.cat(theirs)
    return float((a - b).abs().max() / b.abs().max())


def ours(adapter: CausalLMAdapter, batch: dict[str, torch.Tensor], **changes: object) -> dict[str, torch.Tensor]:
    return attribute_batch(adapter, batch, settings_of(adapter, **changes), settings_of(adapter).planner())


def real_scores(values: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [s[m.bool()] for s, m in zip(values["token_scores"], batch["attention_mask"])]


def test_the_forward_equals_a_plain_forward_of_each_sample_alone(adapter: CausalLMAdapter) -> None:
    tok = adapter.tokenizer
    expected = []
    for prompt, completion in PAIRS:
        n = len(tok(completion, add_special_tokens=False)["input_ids"])
        ids = torch.tensor([tok(prompt)["input_ids"] + tok(completion, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            logp = adapter.model(input_ids=ids).logits.log_softmax(-1)[0, -n - 1 : -1]
        expected.append(float(logp.gather(1, ids[0, -n:, None]).sum()))
    for side in ("right", "left"):
        got = adapter.logits(batch_of(adapter, side))[:, 0]
        assert torch.allclose(got, torch.tensor(expected, dtype=got.dtype), rtol=1e-12, atol=1e-12), side
    # a model whose output layer the adapter cannot reach: every position's logits, then the needed ones
    adapter.model.get_output_embeddings = lambda: None
    try:
        every = adapter.logits(batch_of(adapter, "left"))[:, 0]
    finally:
        del adapter.model.get_output_embeddings
    assert torch.allclose(every, torch.tensor(expected, dtype=every.dtype), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("side", ["right", "left"])
def test_whole_completion_scores_match_captum(adapter: CausalLMAdapter, side: str) -> None:
    batch = batch_of(adapter, side)
    values = ours(adapter, batch)
    theirs = [captum_scores(adapter, p, c, None) for p, c in PAIRS]
    assert rel_error(real_scores(values, batch), theirs) <= 1e-5
    # the structure is kept: BOS has no attribution
    assert all(float(s[0]) == 0.0 for s in real_scores(values, batch))


def test_per_token_scores_match_captum(adapter: CausalLMAdapter) -> None:
    batch = batch_of(adapter, "left", per_token=True)
    values = ours(adapter, batch)
    theirs = []
    for i, (prompt, completion) in enumerate(PAIRS):
        length = int(batch_of(adapter)["completion_mask"][i].sum())
        theirs += [captum_scores(adapter, prompt, completion, t) for t in range(length)]
    assert rel_error(real_scores(values, batch), theirs) <= 1e-5


def test_left_and_right_padding_give_the_same_attributions(adapter: CausalLMAdapter) -> None:
    right, left = (ours(adapter, batch_of(adapter, side), n_steps="auto", tolerance=1e-2) for side in ("right", "left"))
    for a, b in zip(real_scores(right, batch_of(adapter)), real_scores(left, batch_of(adapter, "left"))):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12)
    assert torch.equal(right["steps"], left["steps"])


def test_per_token_rows_add_up_to_the_whole_completion(adapter: CausalLMAdapter) -> None:
    whole = ours(adapter, batch_of(adapter))["token_scores"]
    rows = batch_of(adapter, per_token=True)
    parts = ours(adapter, rows)["token_scores"]
    sample = torch.repeat_interleave(torch.arange(len(PAIRS)), batch_of(adapter)["completion_mask"].sum(1))
    summed = torch.zeros_like(whole).index_add_(0, sample, parts)
    assert torch.allclose(summed, whole, rtol=1e-6, atol=1e-7)  # token_scores are written in fp32


def test_auto_steps_are_complete_within_the_tolerance(adapter: CausalLMAdapter) -> None:
    """Completeness: the scores add up to log p(x) - log p(baseline), to the tolerance the verdict reports (one
    baseline per family, in turn: zero vectors make RMSNorm models' integrands hard near the baseline)."""
    baseline = ("zero", "zero-all", "unk")[FAMILIES.index(adapter.name) % 3]
    batch = batch_of(adapter)
    values = ours(adapter, batch, n_steps="auto", tolerance=1e-3, baseline=baseline)
    change = values["scores"] - values["baseline_scores"]
    sums = values["token_scores"].sum(1)
    assert bool(values["within"].all())
    assert float(((sums - change).abs() / change.abs()).max()) <= 1e-3
    assert torch.allclose(values["scores"], adapter.logits(batch)[:, 0].to(values["scores"].dtype))
    bos_scores = values["token_scores"][:, 0]
    assert bool((bos_scores != 0).all()) if baseline == "zero-all" else bool((bos_scores == 0).all())


def test_greedy_generation_matches_a_plain_greedy_loop(adapter: CausalLMAdapter) -> None:
    tok = adapter.tokenizer
    got = adapter.generate(adapter.tokenize([p for p, _ in PAIRS], 32), max_new_tokens=5)
    for i, (prompt, _) in enumerate(PAIRS):
        ids = torch.tensor([tok(prompt)["input_ids"]])
        expected = []
        while len(expected) < 5 and (not expected or expected[-1] != EOS):
            with torch.no_grad():
                nxt = int(adapter.model(input_ids=ids).logits[0, -1].argmax())
            expected.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
        assert got["completion_ids"][i][got["completion_mask"][i].bool()].tolist() == expected


def test_chat_template_and_special_tokens(adapter: CausalLMAdapter) -> None:
    plain = adapter.tokenize(["the cat"], 32)["input_ids"][0].tolist()
    assert plain[0] == BOS and len(plain) == 3  # special tokens added to the prompt
    assert adapter.completions(["the cat"], 32)["completion_ids"][0].tolist() == plain[1:]  # none to the completion
    chat = adapter.tokenize(["the cat"], 32, chat=True)["input_ids"][0]
    assert adapter.tokens(chat.tolist()) == ["<|user|>", "the", "cat", "<|assistant|>"]
    assert set(chat.tolist()) - set(plain) <= adapter.special_ids.non_content()


def test_targets_other_than_the_completion_are_refused(adapter: CausalLMAdapter) -> None:
    with pytest.raises(UserError, match="causal LM"):
        ours(adapter, batch_of(adapter), target="1")
