"""TracIn scores against an independent float64 reference, and the identities they must satisfy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_tracin_support import (
    bert_adapter,
    link_adapter,
    max_rel_error,
    naive_gradients,
    naive_tracin,
    save_checkpoints,
    text_dataset,
    triples,
)

from gpuopt_tui.jobs.tracin import (
    GradientComputer,
    Projector,
    TracInOptions,
    select_parameters,
    self_influence,
    tracin_scores,
)


@pytest.fixture(scope="module")
def bert64(tmp_path_factory: pytest.TempPathFactory):
    adapter = bert_adapter(torch.float64)
    checkpoints = save_checkpoints(adapter, tmp_path_factory.mktemp("ckpt"))
    return adapter, checkpoints, text_dataset(adapter, 14, seed=1), text_dataset(adapter, 5, seed=2)


def names_for(adapter, ds, layers: str, n_last: int = 1, names: tuple[str, ...] = ()) -> list[str]:
    return select_parameters(adapter, ds.batch([0]), layers, n_last, names)


@pytest.mark.parametrize(
    ("layers", "n_last", "method"),
    [("last", 1, "closed_form"), ("last", 2, "closed_form"), ("last", 2, "vmap"), ("all", 1, "vmap")],
)
def test_scores_match_naive_backward_loop_in_float64(bert64, layers: str, n_last: int, method: str) -> None:
    adapter, checkpoints, train, test = bert64
    names = names_for(adapter, test, layers, n_last)
    result = tracin_scores(adapter, checkpoints, train, test, names, TracInOptions(method=method, batch_size=4))
    reference, reference_self = naive_tracin(adapter, checkpoints, train, test, names)
    assert result.stats["method"] == method
    assert result.matrix is not None and result.matrix.dtype == torch.float64
    assert max_rel_error(result.matrix, reference) < 1e-6
    assert max_rel_error(result.self_influence, reference_self) < 1e-6
    assert reference.abs().max() > 1e-3  # the comparison is not between near-zero numbers


def test_closed_form_equals_vmap_on_the_same_parameters(bert64) -> None:
    adapter, checkpoints, train, test = bert64
    names = names_for(adapter, test, "last", 2)  # pooler dense + classifier, weights and biases
    assert names == ["bert.pooler.dense.weight", "bert.pooler.dense.bias", "classifier.weight", "classifier.bias"]
    closed = tracin_scores(adapter, checkpoints, train, test, names, TracInOptions(method="closed_form"))
    vmapped = tracin_scores(adapter, checkpoints, train, test, names, TracInOptions(method="vmap"))
    assert max_rel_error(closed.matrix, vmapped.matrix) < 1e-10
    assert max_rel_error(closed.self_influence, vmapped.self_influence) < 1e-10


def test_closed_form_handles_layers_applied_to_every_token(bert64) -> None:
    """Linear layers inside the encoder see [B, seq, hidden]: their gradient sums over positions."""
    adapter, checkpoints, train, test = bert64
    names = names_for(adapter, test, "names", names=("bert.encoder.layer.1.intermediate.dense", "classifier"))
    closed = tracin_scores(adapter, checkpoints[:1], train, test, names, TracInOptions(method="closed_form"))
    reference, _ = naive_tracin(adapter, checkpoints[:1], train, test, names)
    assert max_rel_error(closed.matrix, reference) < 1e-6


def test_self_influence_is_lr_weighted_squared_gradient_norm(bert64) -> None:
    adapter, checkpoints, train, test = bert64
    names = names_for(adapter, test, "last", 2)
    expected = torch.zeros(len(train), dtype=torch.float64)
    for ckpt in checkpoints:
        adapter.load_weights(ckpt.path)
        expected += ckpt.lr * naive_gradients(adapter, train, names).square().sum(1)
    got = self_influence(adapter, checkpoints, train, names)
    assert max_rel_error(got, expected) < 1e-10


def test_swapping_train_and_test_transposes_the_scores(bert64) -> None:
    adapter, checkpoints, train, test = bert64
    names = names_for(adapter, test, "all")
    forward = tracin_scores(adapter, checkpoints, train, test, names, TracInOptions(batch_size=6))
    swapped = tracin_scores(adapter, checkpoints, test, train, names, TracInOptions(batch_size=3))
    assert max_rel_error(swapped.matrix, forward.matrix.T) < 1e-10


def test_full_size_projection_changes_nothing(bert64) -> None:
    """With projection_dim >= every tensor's size each factor is a random rotation: scores are exact, which
    also shows train and test share the same projection."""
    adapter, checkpoints, train, test = bert64
    names = names_for(adapter, test, "all")
    n_params = sum(p.numel() for p in adapter.model.parameters())
    exact = tracin_scores(adapter, checkpoints, train, test, names)
    projected = tracin_scores(adapter, checkpoints, train, test, names, TracInOptions(projection_dim=n_params, seed=7))
    assert max_rel_error(projected.matrix, exact.matrix) < 1e-10
    assert max_rel_error(projected.self_influence, exact.self_influence) < 1e-10


def test_projection_is_seeded_and_the_same_for_both_gradient_methods(bert64) -> None:
    adapter, checkpoints, train, test = bert64
    names = names_for(adapter, test, "last", 2)
    runs = {
        (method, seed): tracin_scores(
            adapter, checkpoints, train, test, names, TracInOptions(method=method, projection_dim=16, seed=seed)
        ).matrix
        for method in ("closed_form", "vmap")
        for seed in (0, 1)
    }
    assert max_rel_error(runs["closed_form", 0], runs["vmap", 0]) < 1e-10
    assert max_rel_error(runs["closed_form", 0], runs["closed_form", 1]) > 1e-3  # another seed, another sketch


@pytest.mark.parametrize("shape", [(40,), (12, 9)])
def test_projected_inner_products_are_unbiased(shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(2, *shape, generator=gen, dtype=torch.float64)
    exact = float((g[0] * g[1]).sum())
    estimates = []
    for seed in range(400):
        proj = Projector(8, seed, torch.device("cpu"), torch.float64)
        p = proj.dense("w", g)
        assert p.shape == (2, proj.size(shape)) and proj.size(shape) <= 8
        estimates.append(float(p[0] @ p[1]))
    mean = torch.tensor(estimates).mean()
    spread = torch.tensor(estimates).std() / 20  # standard error of the mean over 400 draws
    assert abs(mean - exact) < 4 * spread
    assert abs(mean - exact) < 0.2 * float(g[0].norm() * g[1].norm())


def test_knowledge_graph_scorer_with_bce_loss(tmp_path: Path) -> None:
    """A plugged-in loss (binary cross-entropy over every candidate tail, as ConvE uses) goes through the same
    engine: every parameter by vmap, the decoder by the closed form, both against the naive loop."""
    adapter = link_adapter(torch.float64)
    checkpoints = save_checkpoints(adapter, tmp_path, lrs=(0.2, 0.1), scale=0.3)
    train, test = triples(adapter, 16, seed=3), triples(adapter, 4, seed=4)
    batch = train.batch([0, 1])
    ce = torch.nn.functional.cross_entropy(adapter.logits(batch), batch["labels"], reduction="none")
    assert not torch.allclose(adapter.loss_per_example(batch), ce)
    for layers, method in (("all", "vmap"), ("last", "closed_form")):
        names = names_for(adapter, test, layers)
        result = tracin_scores(adapter, checkpoints, train, test, names, TracInOptions(batch_size=5))
        reference, reference_self = naive_tracin(adapter, checkpoints, train, test, names)
        assert result.stats["method"] == method
        assert max_rel_error(result.matrix, reference) < 1e-6
        assert max_rel_error(result.self_influence, reference_self) < 1e-6


def test_gradient_checkpointing_gives_the_same_scores_and_recomputes(bert64) -> None:
    adapter, _, train, test = bert64
    linear = [n for n, m in adapter.model.named_modules() if isinstance(m, torch.nn.Linear)]
    names = names_for(adapter, test, "names", names=tuple(linear))
    calls = []
    handle = adapter.model.bert.encoder.layer[0].output.dense.register_forward_hook(lambda *_: calls.append(1))
    try:
        plain = GradientComputer(adapter, names).features(train.batch(range(4)))
        n_plain = len(calls)
        recomputed = GradientComputer(adapter, names, gradient_checkpointing=True).features(train.batch(range(4)))
    finally:
        handle.remove()
    assert n_plain == 1 and len(calls) - n_plain == 2  # forward, then again in the backward pass
    assert max_rel_error(recomputed.inner(recomputed), plain.inner(plain)) < 1e-10
    assert not any(m.training for m in adapter.model.modules())
    assert not adapter.word_embeddings()._forward_hooks  # checkpointing's input-grad hook is gone again
