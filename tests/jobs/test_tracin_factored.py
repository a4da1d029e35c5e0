"""The factored projection of per-example gradients (jobs/tracin/factored.py) in float64: equal to the dense
projection of explicitly formed per-example gradients (padding included), exact when no side is projected or the
projections are as wide as the layers, for an encoder, a decoder with Conv1D layers, and a plugin model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_tracin_support import (
    VOCAB,
    bert_adapter,
    link_adapter,
    max_rel_error,
    naive_gradients,
    naive_tracin,
    save_checkpoints,
    text_dataset,
    triples,
)
from transformers import BertTokenizer, GPT2Config, GPT2ForSequenceClassification

from gpuopt_tui.jobs.models.base import Adapter
from gpuopt_tui.jobs.models.hf import SequenceClassifierAdapter
from gpuopt_tui.jobs.tracin import TracInOptions, rank_correlation, select_parameters, tracin_scores
from gpuopt_tui.jobs.tracin.factored import FactoredGradients


def gpt2_adapter() -> Adapter:
    torch.manual_seed(3)
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=2, num_labels=3, pad_token_id=0)
    model = GPT2ForSequenceClassification(config).double()
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(VOCAB - 5)]
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(words)})
    return SequenceClassifierAdapter("tiny-gpt2", model, tokenizer, 3, torch.device("cpu"))


def dense_projection(fg: FactoredGradients, flat: torch.Tensor) -> torch.Tensor:
    """Project explicitly formed per-example gradients [N, P] (P: fg.names in order) parameter by parameter:
    P0^T G P1 for matrices, P^T v for vectors, with the factors the engine draws (the identity on a side whose
    size is the layer's own)."""
    parts, offset = [], 0
    for name in fg.names:
        shape, sizes = fg.shapes[name], fg.sizes[name]
        size = shape[0] * (shape[1] if len(shape) > 1 else 1)
        grad = flat[:, offset : offset + size].reshape(-1, *shape)
        offset += size
        factors = [
            torch.eye(d, dtype=flat.dtype) if k == d else fg.projector.factor(name, axis, d, k)
            for axis, (d, k) in enumerate(zip(shape, sizes))
        ]
        if len(shape) == 1:
            parts.append(grad @ factors[0])
        else:
            parts.append(torch.einsum("bmn,mk,nl->bkl", grad, factors[0], factors[1]).reshape(len(flat), -1))
    return torch.cat(parts, 1)


@pytest.mark.parametrize("maker", [bert_adapter, gpt2_adapter], ids=["bert", "gpt2"])
def test_factored_equals_dense_projection_of_explicit_gradients(maker) -> None:
    adapter = maker() if maker is gpt2_adapter else maker(torch.float64)
    ds = text_dataset(adapter, 7, seed=4)
    assert bool((ds.tensors["attention_mask"] == 0).any())  # padding is part of the test
    names = select_parameters(adapter, ds.batch([0]), "all")
    fg = FactoredGradients(adapter, names, k_in=5, k_out=3, seed=11, precision="fp32")
    assert fg.excluded == {} and fg.names == names
    got = fg.features(ds.batch(list(range(len(ds)))))
    want = dense_projection(fg, naive_gradients(adapter, ds, names).double())
    assert got.shape == want.shape == (len(ds), fg.size())
    assert max_rel_error(got, want) < 1e-12


def test_inputs_that_require_grad_do_not_hide_any_layer(monkeypatch) -> None:
    """A hook that makes the word embeddings require grad (what enabling gradient checkpointing leaves behind): the
    layers after it need a gradient before the engine's own anchor, and their gradients must still all arrive."""
    adapter = gpt2_adapter()
    ds = text_dataset(adapter, 5, seed=2)
    names = [n for n in select_parameters(adapter, ds.batch([0]), "all") if ".h." in n]  # not the embeddings
    fg = FactoredGradients(adapter, names, k_in=5, k_out=3, seed=11, precision="fp32")
    batch = ds.batch(list(range(len(ds))))
    want = dense_projection(fg, naive_gradients(adapter, ds, names).double())
    embeddings = adapter.model.get_input_embeddings()
    handle = embeddings.register_forward_hook(lambda module, args, out: out.requires_grad_(True))
    try:
        got = fg.features(batch)
    finally:
        handle.remove()
    assert max_rel_error(got, want) < 1e-12
    assert bool((got.abs().sum(0) > 0).all())


@pytest.fixture(scope="module")
def bert64(tmp_path_factory: pytest.TempPathFactory):
    adapter = bert_adapter(torch.float64)
    checkpoints = save_checkpoints(adapter, tmp_path_factory.mktemp("ckpt"))
    return adapter, checkpoints, text_dataset(adapter, 12, seed=1), text_dataset(adapter, 5, seed=2)


@pytest.mark.parametrize("sizes", [(0, 0), (10_000, 10_000)], ids=["unprojected", "full-width-rotations"])
def test_full_size_projections_reproduce_exact_all_parameter_tracin(bert64, sizes: tuple[int, int]) -> None:
    adapter, checkpoints, train, test = bert64
    names = select_parameters(adapter, test.batch([0]), "all")
    options = TracInOptions(method="factored", projection_in=sizes[0], projection_out=sizes[1], batch_size=5)
    result = tracin_scores(adapter, checkpoints, train, test, names, options)
    reference, reference_self = naive_tracin(adapter, checkpoints, train, test, names)
    assert result.stats["method"] == "factored" and result.stats["excluded_parameters"] == {}
    assert result.stats["gradient_size"] == sum(p.numel() for p in adapter.model.parameters())
    assert max_rel_error(result.matrix, reference) < 1e-10
    assert max_rel_error(result.self_influence, reference_self) < 1e-10


def test_projected_scores_rank_like_exact_ones_and_depend_on_the_seed(bert64) -> None:
    adapter, checkpoints, train, test = bert64
    names = select_parameters(adapter, test.batch([0]), "all")
    reference, _ = naive_tracin(adapter, checkpoints, train, test, names)
    runs = [
        tracin_scores(
            adapter, checkpoints, train, test, names,
            TracInOptions(method="factored", projection_in=16, projection_out=16, seed=seed),
        ).matrix
        for seed in (0, 0, 1)
    ]  # fmt: skip
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    assert rank_correlation(runs[0], reference) > 0.8


def test_plugin_model_with_embeddings_and_linear_layers_is_exact(tmp_path: Path) -> None:
    adapter = link_adapter()
    checkpoints = save_checkpoints(adapter, tmp_path)
    train, test = triples(adapter, 9, seed=1), triples(adapter, 4, seed=2)
    names = select_parameters(adapter, test.batch([0]), "all")
    result = tracin_scores(adapter, checkpoints, train, test, names, TracInOptions(method="factored"))
    reference, _ = naive_tracin(adapter, checkpoints, train, test, names)
    assert max_rel_error(result.matrix, reference) < 1e-10


def test_parameters_outside_supported_layers_are_excluded_and_listed() -> None:
    adapter = bert_adapter(torch.float64)
    extra = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    adapter.model.register_parameter("temperature", extra)  # owned by no Linear, Embedding or LayerNorm
    names = ["temperature", "classifier.weight"]
    fg = FactoredGradients(adapter, names, k_in=0, k_out=0, seed=0, precision="fp32")
    assert list(fg.excluded) == ["temperature"] and fg.names == ["classifier.weight"]
    assert "BertForSequenceClassification is not a Linear" in fg.excluded["temperature"]


def test_a_module_registered_under_two_names_counts_once() -> None:
    adapter = bert_adapter(torch.float64)
    adapter.model.head_alias = adapter.model.classifier  # the same layer reachable by a second name
    ds = text_dataset(adapter, 4, seed=1)
    names = ["classifier.weight", "classifier.bias"]
    fg = FactoredGradients(adapter, names, k_in=0, k_out=0, seed=0, precision="fp32")
    got = fg.features(ds.batch(list(range(len(ds)))))
    assert max_rel_error(got, naive_gradients(adapter, ds, names).double()) < 1e-12


class OnePlusWeightLayerNorm(torch.nn.LayerNorm):
    """A LayerNorm that scales by 1 + weight (the convention of Gemma's RMSNorm) in a forward of its own."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(input, self.normalized_shape, 1 + self.weight, self.bias, self.eps)


def test_a_layer_subclass_with_its_own_forward_is_left_out_with_the_reason() -> None:
    """The factorisation assumes a LayerNorm computes x_hat * weight + bias; a subclass that computes something
    else has its parameters left out (named, with why), and every other parameter keeps its exact gradient."""
    adapter = bert_adapter(torch.float64)
    norm = "bert.embeddings.LayerNorm"
    adapter.model.bert.embeddings.LayerNorm.__class__ = OnePlusWeightLayerNorm
    ds = text_dataset(adapter, 5, seed=4)
    names = select_parameters(adapter, ds.batch([0]), "all")
    fg = FactoredGradients(adapter, names, k_in=0, k_out=0, seed=0, precision="fp32")
    assert list(fg.excluded) == [f"{norm}.weight", f"{norm}.bias"]
    assert fg.excluded[f"{norm}.weight"] == (
        f"{norm}: OnePlusWeightLayerNorm replaces LayerNorm.forward, so its output need not be the layer's plain "
        "product"
    )
    assert fg.names == [n for n in names if n not in fg.excluded]
    got = fg.features(ds.batch(list(range(len(ds)))))
    assert max_rel_error(got, naive_gradients(adapter, ds, fg.names).double()) < 1e-12


def test_faithfulness_check_of_exact_factored_scores_is_perfect_and_of_last_layers_is_not(bert64) -> None:
    from gpuopt_tui.jobs.tracin import Reporter
    from gpuopt_tui.jobs.tracin.agreement import top_k_overlap
    from gpuopt_tui.jobs.tracin.faithfulness import exact_agreement

    adapter, checkpoints, train, test = bert64
    everything = select_parameters(adapter, test.batch([0]), "all")
    same = exact_agreement(
        adapter, checkpoints, train, test, everything, TracInOptions(method="factored"), 8, Reporter()
    )
    assert same["spearman"] == pytest.approx(1.0) and same["top_k_overlap"] == 1.0 and same["n_train"] == 8
    last = select_parameters(adapter, test.batch([0]), "last", 1)
    other = exact_agreement(adapter, checkpoints, train, test, last, TracInOptions(), 8, Reporter())
    assert other["spearman"] < 1.0
    scores = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert top_k_overlap(scores, -scores, 2) == 0.0 and top_k_overlap(scores, scores * 2, 2) == 1.0
    assert "fp32" not in same  # an fp32 run has no other precision to compare


def test_faithfulness_check_of_a_low_precision_run_also_scores_its_settings_in_fp32(bert64) -> None:
    from gpuopt_tui.jobs.tracin import Reporter
    from gpuopt_tui.jobs.tracin.faithfulness import exact_agreement

    adapter, checkpoints, train, test = bert64
    everything = select_parameters(adapter, test.batch([0]), "all")
    options = TracInOptions(method="factored", precision="bf16", projection_in=4, projection_out=4)
    found = exact_agreement(adapter, checkpoints, train, test, everything, options, 8, Reporter())
    assert found["precision"] == "bf16"
    exact = dataclasses.replace(options, projection_in=0, projection_out=0)
    unprojected = exact_agreement(adapter, checkpoints, train, test, everything, exact, 8, Reporter())
    assert unprojected["fp32"]["spearman"] == pytest.approx(1.0) and unprojected["fp32"]["top_k_overlap"] == 1.0
    assert -1 <= found["fp32"]["spearman"] <= 1 and 0 <= found["fp32"]["top_k_overlap"] <= 1


def test_precision_advice_names_the_setting_only_when_fp32_agrees_clearly_better() -> None:
    from gpuopt_tui.jobs.tracin.faithfulness import PRECISION_MARGIN, precision_advice

    low = {"precision": "bf16", "spearman": 0.72, "top_k": 10, "top_k_overlap": 0.2}
    advice = precision_advice({**low, "fp32": {"spearman": 0.93, "top_k_overlap": 0.55}})
    assert advice is not None
    assert "Spearman 0.930 (top-10 overlap 55%)" in advice and "bf16 0.720 (20%)" in advice
    assert "tracin.use_amp = false" in advice
    close = {"spearman": 0.72 + PRECISION_MARGIN / 2, "top_k_overlap": 0.2}
    assert precision_advice({**low, "fp32": close}) is None
    assert precision_advice(low) is None  # not checked: an fp32 run


def test_projection_advice_names_what_agrees_better_below_the_wanted_agreement() -> None:
    from gpuopt_tui.jobs.tracin.faithfulness import WANTED_SPEARMAN, projection_advice

    low = {"precision": "fp32", "spearman": 0.57, "top_k": 10, "top_k_overlap": 0.4}
    factored = TracInOptions(method="factored", projection_in=16, projection_out=16)
    advice = projection_advice(low, factored)
    assert advice is not None and "Spearman 0.570" in advice and 'projection_basis = "pca"' in advice
    fitted = projection_advice(low, dataclasses.replace(factored, projection_basis="pca"))
    assert fitted is not None and "larger projection_in and projection_out" in fitted and "pca" not in fitted
    dense = projection_advice(low, TracInOptions(method="closed_form", projection_dim=64))
    assert dense is not None and "a larger projection_dim" in dense
    assert projection_advice({**low, "spearman": WANTED_SPEARMAN}, factored) is None
    assert projection_advice(low, TracInOptions(method="factored")) is None  # exact gradients: nothing to widen
    costly = {**low, "precision": "bf16", "fp32": {"spearman": 0.95, "top_k_overlap": 0.8}}
    assert projection_advice(costly, factored) is None  # the precision is what costs (precision_advice)
