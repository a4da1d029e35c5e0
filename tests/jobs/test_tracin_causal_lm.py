"""TracIn on causal LMs (prompt -> completion, loss = mean token cross-entropy over the completion) on tiny random
decoders, in float64, against a naive reference: each example alone and unpadded through the model's own labelled
loss (prompt labels -100), one loss.backward() per example, flattened gradients dotted and summed over checkpoints
with their learning rates."""

from __future__ import annotations

import pytest
import torch
from lm_cases import FAMILIES, tiny_decoder, tiny_tokenizer
from test_tracin_support import max_rel_error, save_checkpoints

from gpuopt_tui.jobs.data import TextDataset
from gpuopt_tui.jobs.models.causal_lm import WHOLE_COMPLETION, CausalLMAdapter
from gpuopt_tui.jobs.tracin import TracInOptions, select_parameters, tracin_scores
from gpuopt_tui.jobs.tracin.grads import linear_owners

CPU = torch.device("cpu")
TRAIN = [
    ("the cat sat on the", "big red mat"),
    ("a dog", "ran"),
    ("the small blue dog ran under the", "rug"),
    ("a happy cat", "sat on the mat"),
    ("the red", "dog ran on the big rug"),
]
TEST = [("the dog sat", "on the mat"), ("a small cat ran under", "the blue rug")]


def dataset(adapter: CausalLMAdapter, pairs: list[tuple[str, str]], side: str = "right") -> TextDataset:
    tensors = adapter.tokenize([p for p, _ in pairs], 32) | adapter.completions([c for _, c in pairs], 32)
    tensors["target_position"] = torch.full((len(pairs),), WHOLE_COMPLETION)
    if side == "left":  # the padding moved before the tokens (a stable sort of the mask keeps their order)
        order = tensors["attention_mask"].sort(dim=1, stable=True).indices
        tensors["input_ids"] = tensors["input_ids"].gather(1, order)
        tensors["attention_mask"] = tensors["attention_mask"].gather(1, order)
    meta = {"completions": [c for _, c in pairs]}
    return TextDataset(tensors, [p for p, _ in pairs], dict(adapter.token_fields), "pairs", meta)


def reference_loss(adapter: CausalLMAdapter, ds: TextDataset, i: int) -> torch.Tensor:
    """Mean cross-entropy of example i's completion tokens, from the model's logits of [prompt | completion] alone
    and unpadded (the model's own labelled loss would round the logits to float32)."""
    t = ds.tensors
    prompt = t["input_ids"][i][t["attention_mask"][i].bool()]
    completion = t["completion_ids"][i][t["completion_mask"][i].bool()]
    ids = torch.cat([prompt, completion])[None]
    logits = adapter.model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return torch.nn.functional.cross_entropy(logits, completion)


def reference_tracin(adapter, checkpoints, train: TextDataset, test: TextDataset, names: list[str]) -> torch.Tensor:
    params = dict(adapter.model.named_parameters())

    def gradients(ds: TextDataset) -> torch.Tensor:
        rows = []
        for i in range(len(ds)):
            adapter.model.zero_grad(set_to_none=True)
            reference_loss(adapter, ds, i).backward()
            rows.append(torch.cat([params[n].grad.reshape(-1) for n in names]))
        adapter.model.zero_grad(set_to_none=True)
        return torch.stack(rows)

    scores = torch.zeros(len(test), len(train), dtype=torch.float64)
    for ckpt in checkpoints:
        adapter.load_weights(ckpt.path)
        scores += ckpt.lr * gradients(test) @ gradients(train).T
    return scores


@pytest.fixture(scope="module", params=FAMILIES)
def lm64(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    adapter = CausalLMAdapter(request.param, tiny_decoder(request.param).double(), tiny_tokenizer(), CPU)
    checkpoints = save_checkpoints(adapter, tmp_path_factory.mktemp("ckpt"), scale=0.05)
    return adapter, checkpoints


def names_of(adapter: CausalLMAdapter, ds: TextDataset, n_last: int) -> list[str]:
    return select_parameters(adapter, ds.batch([0]), "last", n_last, ())


@pytest.mark.parametrize(("n_last", "method"), [(3, "auto"), (2, "closed_form"), (3, "factored")])
def test_scores_match_a_naive_per_example_loop(lm64, n_last: int, method: str) -> None:
    adapter, checkpoints = lm64
    train, test = dataset(adapter, TRAIN), dataset(adapter, TEST)
    names = names_of(adapter, test, n_last)
    if method == "closed_form":  # the last parameters that belong to an nn.Linear of their own
        names = [n for n, _ in adapter.model.named_parameters() if linear_owners(adapter.model, [n])][-n_last:]
        if not names:
            pytest.skip(f"{adapter.name} has no nn.Linear of its own (Conv1D layers, a tied output layer)")
    result = tracin_scores(adapter, checkpoints, train, test, names, TracInOptions(method=method, batch_size=3))
    excluded = result.stats["excluded_parameters"]  # factored: tensors it cannot differentiate exactly (RMSNorm)
    scored = [n for n in names if n not in excluded]
    assert len(scored) >= len(names) // 2
    reference = reference_tracin(adapter, checkpoints, train, test, scored)
    assert result.matrix is not None
    assert max_rel_error(result.matrix, reference) < 1e-6
    assert reference.abs().max() > 1e-3  # the comparison is not between near-zero numbers


class ScaledEmbedding(torch.nn.Embedding):
    """An embedding whose rows are scaled by a constant in its own forward, as Gemma's are by sqrt(hidden size)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 4.0


@pytest.mark.parametrize("scaled", [False, True], ids=["plain-embedding", "scaled-embedding"])
def test_factored_scores_of_a_tied_output_layer_are_exact_or_left_out(tmp_path, scaled: bool) -> None:
    """A Llama whose output layer shares the embedding's weight: that weight's two uses (the lookup and the output
    projection) add up, their cross terms included. An embedding with a forward of its own is not the plain lookup
    the factorisation assumes: its weight is left out with the reason, not counted with a wrong gradient."""
    model = tiny_decoder("llama").double()
    model.lm_head.weight = model.model.embed_tokens.weight
    if scaled:
        model.model.embed_tokens.__class__ = ScaledEmbedding
    adapter = CausalLMAdapter("llama", model, tiny_tokenizer(), CPU)
    checkpoints = save_checkpoints(adapter, tmp_path, scale=0.05)
    train, test = dataset(adapter, TRAIN), dataset(adapter, TEST)
    names = ["model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"]
    result = tracin_scores(adapter, checkpoints, train, test, names, TracInOptions(method="factored", batch_size=3))
    excluded = result.stats["excluded_parameters"]
    if scaled:
        assert list(excluded) == ["model.embed_tokens.weight"]
        assert "ScaledEmbedding replaces Embedding.forward" in excluded["model.embed_tokens.weight"]
    else:
        assert excluded == {}
    reference = reference_tracin(adapter, checkpoints, train, test, [n for n in names if n not in excluded])
    assert max_rel_error(result.matrix, reference) < 1e-6
    assert reference.abs().max() > 1e-3


def test_left_and_right_padding_give_equal_scores(lm64) -> None:
    """In micro-batches of 2, each cut to its own real positions (leading ones of left padding)."""
    adapter, checkpoints = lm64
    names = names_of(adapter, dataset(adapter, TEST), 2)
    right = tracin_scores(
        adapter, checkpoints, dataset(adapter, TRAIN), dataset(adapter, TEST), names, TracInOptions(batch_size=2)
    )
    left = tracin_scores(
        adapter,
        checkpoints,
        dataset(adapter, TRAIN, "left"),
        dataset(adapter, TEST, "left"),
        names,
        TracInOptions(batch_size=2),
    )
    assert max_rel_error(left.matrix, right.matrix) < 1e-9


def test_only_completion_tokens_count(lm64) -> None:
    """The loss is the model's own labelled loss with the prompt's labels masked (-100), not with them counted; a
    changed completion token changes the scores."""
    adapter, checkpoints = lm64
    train = dataset(adapter, TRAIN)
    ours = adapter.loss_per_example(train.tensors)
    t = train.tensors
    for i in range(len(train)):
        prompt = t["input_ids"][i][t["attention_mask"][i].bool()]
        completion = t["completion_ids"][i][t["completion_mask"][i].bool()]
        ids = torch.cat([prompt, completion])[None]
        masked = torch.cat([torch.full_like(prompt, -100), completion])[None]
        assert torch.isclose(ours[i], adapter.model(input_ids=ids, labels=masked).loss.double(), rtol=1e-5)
        assert not torch.isclose(ours[i], adapter.model(input_ids=ids, labels=ids).loss.double(), rtol=1e-3)
    names = names_of(adapter, train, 2)
    before = tracin_scores(adapter, checkpoints, train, dataset(adapter, TEST), names, TracInOptions()).matrix
    changed = dataset(adapter, TRAIN)
    changed.tensors["completion_ids"][0, 0] = changed.tensors["completion_ids"][1, 0]
    after = tracin_scores(adapter, checkpoints, changed, dataset(adapter, TEST), names, TracInOptions()).matrix
    assert max_rel_error(after[:, 1:], before[:, 1:]) < 1e-12
    assert max_rel_error(after[:, :1], before[:, :1]) > 1e-3


def test_sdpa_attention_gives_the_scores_of_eager_attention(lm64) -> None:
    """What a loaded model runs (SDPA; its mask handed over ready-made under vmap) against the eager reference."""
    adapter, checkpoints = lm64
    train, test = dataset(adapter, TRAIN, "left"), dataset(adapter, TEST)
    names = names_of(adapter, test, 3)
    eager = tracin_scores(adapter, checkpoints, train, test, names, TracInOptions(method="vmap")).matrix
    adapter.model.set_attn_implementation("sdpa")
    try:
        sdpa = tracin_scores(adapter, checkpoints, train, test, names, TracInOptions(method="vmap")).matrix
    finally:
        adapter.model.set_attn_implementation("eager")
    assert max_rel_error(sdpa, eager) < 1e-6  # the same bound as against the reference
