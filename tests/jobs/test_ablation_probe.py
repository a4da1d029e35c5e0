"""MLP probes: the split, standardisation with training statistics only, the batched ensemble against
independent models, and training that finds (only) real signal."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from gpuopt_tui.jobs.ablation.probe import (
    EnsembleMLP,
    FeatureTable,
    ProbeSettings,
    Split,
    fit_standardizer,
    stratified_split,
    train_probes,
)

torch.set_num_threads(1)
CPU = torch.device("cpu")


def test_stratified_split_is_a_partition_with_class_proportions() -> None:
    labels = torch.tensor([0] * 60 + [1] * 30 + [2] * 10)
    split = stratified_split(labels, 0.2, 0.1, seed=3)
    everything = torch.cat(split.parts()).sort().values
    assert torch.equal(everything, torch.arange(100))
    assert torch.bincount(labels[split.val]).tolist() == [12, 6, 2]
    assert torch.bincount(labels[split.test]).tolist() == [6, 3, 1]
    again = stratified_split(labels, 0.2, 0.1, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(split.parts(), again.parts()))


def test_standardisation_uses_training_rows_only() -> None:
    """Validation and test rows are shifted far away: statistics that included them would differ widely."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 4, generator=gen) * torch.tensor([1.0, 2.0, 0.5, 3.0]) + 5.0
    split = Split(torch.arange(0, 200), torch.arange(200, 250), torch.arange(250, 300))
    x[200:] += 100.0
    mean, std = fit_standardizer(x, split.train)
    torch.testing.assert_close(mean, x[:200].mean(0, keepdim=True))
    torch.testing.assert_close(std, x[:200].std(0, correction=0, keepdim=True))
    table = FeatureTable([x.numpy()], split.train, CPU, resident=True)
    probe = torch.zeros(1, dtype=torch.long)
    train_rows = table.rows(probe, split.train.unsqueeze(0))[0]
    torch.testing.assert_close(train_rows.mean(0), torch.zeros(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(train_rows.std(0, correction=0), torch.ones(4), atol=1e-5, rtol=0)
    val_rows = table.rows(probe, split.val.unsqueeze(0))[0]
    assert torch.all(val_rows.mean(0) > 10)  # the shift stays visible: it was not standardised away


def test_constant_training_feature_is_not_blown_up() -> None:
    x = torch.ones(10, 2)
    x[:, 1] = torch.arange(10.0)
    x[8:, 0] = 2.0  # constant on the training rows, different elsewhere
    mean, std = fit_standardizer(x, torch.arange(8))
    assert std[0, 0] == 1.0 and mean[0, 0] == 1.0


def _reference_mlp(model: EnsembleMLP, member: int) -> nn.Sequential:
    ref = nn.Sequential(
        nn.Linear(model.w1.shape[1], model.w1.shape[2]), nn.ReLU(), nn.Linear(model.w2.shape[1], model.w2.shape[2])
    )
    with torch.no_grad():
        ref[0].weight.copy_(model.w1[member].T)
        ref[0].bias.copy_(model.b1[member, 0])
        ref[2].weight.copy_(model.w2[member].T)
        ref[2].bias.copy_(model.b2[member, 0])
    return ref.double()


def test_ensemble_trains_like_independent_models() -> None:
    """Three AdamW steps on the stacked ensemble equal three steps of each member trained alone."""
    seeds, steps = [0, 1, 2, 0], 3
    model = EnsembleMLP(seeds, 6, 5, 3, device=CPU).double()
    refs = [_reference_mlp(model, e) for e in range(len(seeds))]
    assert torch.equal(model.w1[0], model.w1[3]) and not torch.equal(model.w1[0], model.w1[1])
    gen = torch.Generator().manual_seed(9)
    batches = [
        (torch.randn(4, 8, 6, generator=gen, dtype=torch.float64), torch.randint(3, (4, 8), generator=gen))
        for _ in range(steps)
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for x, y in batches:
        loss = sum(nn.functional.cross_entropy(model(x)[e], y[e]) for e in range(len(seeds)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    for e, ref in enumerate(refs):
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
        for x, y in batches:
            ref_opt.zero_grad()
            nn.functional.cross_entropy(ref(x[e]), y[e]).backward()
            ref_opt.step()
        torch.testing.assert_close(model(batches[0][0])[e], ref(batches[0][0][e]))


def _signal_data(n: int = 400, seed: int = 0) -> tuple[list[np.ndarray], torch.Tensor]:
    """Feature set 0: label plus noise; feature set 1: noise only."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(2, (n,), generator=gen)
    noise = torch.randn(2, n, 4, generator=gen)
    signal = noise[0] + 2.5 * labels.unsqueeze(1).float() * torch.tensor([1.0, -1.0, 0.0, 0.0])
    return [signal.numpy(), noise[1].numpy()], labels


def test_probes_find_signal_and_stay_at_chance_on_noise() -> None:
    features, labels = _signal_data()
    split = stratified_split(labels, 0.2, 0.2, seed=0)
    table = FeatureTable(features, split.train, CPU, resident=True)
    settings = ProbeSettings(hidden_dim=16, dropout=0.1, max_epochs=40, patience=5, num_runs=3, learning_rate=1e-2)
    results = train_probes(table, labels, split, 2, settings)
    signal_test = np.mean([r.test_acc for r in results[0]])
    noise_test = np.mean([r.test_acc for r in results[1]])
    assert signal_test > 0.9
    assert 0.3 < noise_test < 0.7
    assert all(r.epochs < settings.max_epochs for r in results[1])  # early stopping ended the noise probes
    assert all(1 <= r.best_epoch <= r.epochs for group in results for r in group)


def test_streamed_and_resident_features_train_identically() -> None:
    features, labels = _signal_data(200, seed=1)
    split = stratified_split(labels, 0.2, 0.2, seed=0)
    settings = ProbeSettings(hidden_dim=8, max_epochs=5, num_runs=2)
    a = train_probes(FeatureTable(features, split.train, CPU, True), labels, split, 2, settings)
    b = train_probes(FeatureTable(features, split.train, CPU, False), labels, split, 2, settings)
    assert a == b
