"""MLP probes: how well a layer's features predict the label.

Every probe of a group (G layers with features of the same width, num_runs seeds each) is one member of an
`EnsembleMLP` whose weights are stacked, so a single batched matmul trains all G x num_runs probes at once.
Members are independent: each has its own initialisation, batch order and dropout masks (from its seed), its own
AdamW state (AdamW is element-wise) and its own early stopping on validation loss; the loss is the sum of the
members' losses, so no gradient crosses members. A probe therefore trains the same whatever group it is in
(another group after a resume, another process of a run over several).

Features are standardised with statistics of the training rows only, and stay on the device when they fit
(`FeatureTable`), else in pinned host memory with each batch copied over.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpuopt_tui.jobs.device import autocast


@dataclass(frozen=True)
class ProbeSettings:
    hidden_dim: int = 512
    dropout: float = 0.5
    weight_decay: float = 1e-4
    learning_rate: float = 1e-3
    batch_size: int = 256
    max_epochs: int = 200
    patience: int = 10
    num_runs: int = 10
    precision: str = "fp32"  # fp32, bf16 or fp16 (autocast of the probe's forward)
    seed: int = 0


@dataclass(frozen=True)
class Split:
    train: Tensor
    val: Tensor
    test: Tensor

    def parts(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.train, self.val, self.test


@dataclass(frozen=True)
class MemberResult:
    train_acc: float
    val_acc: float
    test_acc: float
    best_epoch: int  # 1-based epoch of the lowest validation loss (the weights evaluated)
    epochs: int  # epochs trained before early stopping


def stratified_split(labels: Tensor, val_fraction: float, test_fraction: float, seed: int) -> Split:
    """Shuffled index sets with each class spread over train/val/test in the given proportions."""
    gen = torch.Generator().manual_seed(seed)
    parts: list[list[Tensor]] = [[], [], []]
    for cls in torch.unique(labels):
        idx = torch.nonzero(labels == cls).flatten()
        idx = idx[torch.randperm(len(idx), generator=gen)]
        n_val, n_test = round(len(idx) * val_fraction), round(len(idx) * test_fraction)
        parts[1].append(idx[:n_val])
        parts[2].append(idx[n_val : n_val + n_test])
        parts[0].append(idx[n_val + n_test :])
    train, val, test = (torch.cat(p) for p in parts)
    return Split(*(p[torch.randperm(len(p), generator=gen)] for p in (train, val, test)))


def fit_standardizer(x: Tensor, train: Tensor) -> tuple[Tensor, Tensor]:
    """(mean, std) [1, f] of each feature over the training rows `train` of x [N, f]; population std, and 1 for
    features constant on the training rows (they carry nothing the probe could learn)."""
    rows = x[train.to(x.device)].double()
    mean = rows.mean(0, keepdim=True)
    std = rows.std(0, correction=0, keepdim=True)
    std = torch.where(std > 1e-12 * mean.abs().clamp_min(1.0), std, torch.ones_like(std))
    return mean.float(), std.float()


class FeatureTable:
    """The features of G probes (one [N, f] array each, all of width f), standardised with statistics of the
    training rows. `resident`: kept on `device`; otherwise in (pinned) host memory, gathered per batch."""

    def __init__(self, features: Sequence[np.ndarray], train: Tensor, device: torch.device, resident: bool) -> None:
        host = np.empty((len(features), *np.shape(features[0])), dtype=np.float32)
        for g, array in enumerate(features):
            host[g] = array
        x = torch.from_numpy(host)
        if resident:
            x = x.to(device)
        elif device.type == "cuda":
            x = x.pin_memory()
        self.x, self.device = x, device
        stats = [fit_standardizer(layer_features, train) for layer_features in x]
        self.mean = torch.stack([m for m, _ in stats]).to(device)
        self.std = torch.stack([s for _, s in stats]).to(device)

    @property
    def n_probes(self) -> int:
        return self.x.shape[0]

    @property
    def width(self) -> int:
        return self.x.shape[2]

    def rows(self, probe: Tensor, index: Tensor) -> Tensor:
        """[E, B, f] standardised rows: member e gets rows index[e] of the features of probe[e]."""
        where = self.x.device
        x = self.x[probe.to(where).unsqueeze(1), index.to(where)]
        x = x.to(self.device, non_blocking=True)
        return (x - self.mean[probe]) / self.std[probe]


class EnsembleMLP(nn.Module):
    """E independent MLPs in -> hidden -> ReLU -> dropout -> classes with stacked weights [E, ...].

    Member e is initialised from torch.Generator seeded with seeds[e], like nn.Linear (uniform in
    +-1/sqrt(fan_in)), so a member's starting point does not depend on the others. Dropout masks are the
    caller's (see `dropout_keep`)."""

    def __init__(self, seeds: Sequence[int], in_dim: int, hidden: int, classes: int, device: torch.device) -> None:
        super().__init__()
        shapes = {"w1": (in_dim, hidden), "b1": (1, hidden), "w2": (hidden, classes), "b2": (1, classes)}
        fan_in = {"w1": in_dim, "b1": in_dim, "w2": hidden, "b2": hidden}
        init: dict[str, list[Tensor]] = {name: [] for name in shapes}
        for seed in seeds:
            gen = torch.Generator().manual_seed(seed)
            for name, shape in shapes.items():
                bound = 1.0 / math.sqrt(fan_in[name])
                init[name].append((torch.rand(shape, generator=gen) * 2 - 1) * bound)
        for name, tensors in init.items():
            self.register_parameter(name, nn.Parameter(torch.stack(tensors).to(device)))

    def forward(self, x: Tensor, keep: Tensor | None = None) -> Tensor:
        """Logits [E, B, classes] from inputs [E, B, in]; `keep` [E, B, hidden]: a scaled dropout mask."""
        h = torch.relu(torch.baddbmm(self.b1, x, self.w1))
        if keep is not None:
            h = h * keep
        return torch.baddbmm(self.b2, h, self.w2)


def dropout_keep(
    gen: torch.Generator, runs: int, run_of: Tensor, rows: int, hidden: int, p: float, device: torch.device
) -> Tensor | None:
    """The dropout mask of a training step, scaled by 1 / (1 - p): [E, rows, hidden], None for p = 0. One mask
    per seed index (run), shared by the members of that run, so the masks of a member (and of every step) are
    the same whatever the other members of its ensemble are."""
    if p == 0:
        return None
    noise = torch.rand((runs, rows, hidden), generator=gen, device=device)
    return ((noise >= p).float() / (1 - p))[run_of.to(device)]


def train_probes(
    table: FeatureTable,
    labels: Tensor,
    split: Split,
    classes: int,
    settings: ProbeSettings,
    on_epoch: Callable[[int, int], None] | None = None,
) -> list[list[MemberResult]]:
    """Train num_runs probes on each feature set of `table`; results[g][r] for feature set g, seed r.

    `on_epoch(epoch, members still training)` is called after every epoch (progress, cancellation)."""
    device, runs = table.device, settings.num_runs
    probe_of = torch.arange(table.n_probes, device=device).repeat_interleave(runs)
    run_of = torch.arange(runs).repeat(table.n_probes)
    seeds = [_run_seed(settings.seed, int(r)) for r in run_of]
    y = labels.to(device)
    model = EnsembleMLP(seeds, table.width, settings.hidden_dim, classes, device)
    best, best_epoch, epochs = _fit(model, table, y, split, probe_of, run_of, settings, on_epoch)
    with torch.no_grad():
        for p, b in zip(model.parameters(), best):
            p.copy_(b)
    model.eval()
    accs = [_evaluate(model, table, y, idx, probe_of, settings.precision)[1].cpu() for idx in split.parts()]
    results = [
        MemberResult(float(accs[0][e]), float(accs[1][e]), float(accs[2][e]), int(best_epoch[e]), int(epochs[e]))
        for e in range(len(seeds))
    ]
    return [results[g * runs : (g + 1) * runs] for g in range(table.n_probes)]


def _run_seed(seed: int, run: int) -> int:
    return seed * 10_007 + run


def _fit(
    model: EnsembleMLP,
    table: FeatureTable,
    y: Tensor,
    split: Split,
    probe_of: Tensor,
    run_of: Tensor,
    settings: ProbeSettings,
    on_epoch: Callable[[int, int], None] | None,
) -> tuple[list[Tensor], Tensor, Tensor]:
    """The training loop with per-member early stopping; returns the best weights, their epoch and the
    epochs each member trained."""
    device, members = table.device, len(probe_of)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(
        model.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay, fused=fused
    )
    scaler = torch.amp.GradScaler("cuda", enabled=settings.precision == "fp16" and device.type == "cuda")
    train = split.train.to(device)
    shufflers = [torch.Generator().manual_seed(_run_seed(settings.seed, r) + 1) for r in range(settings.num_runs)]
    masks = torch.Generator(device).manual_seed(settings.seed)
    best = [p.detach().clone() for p in model.parameters()]
    best_loss = torch.full((members,), math.inf, device=device)
    best_epoch = torch.zeros(members, dtype=torch.long, device=device)
    waited = torch.zeros(members, dtype=torch.long, device=device)
    stopped_at = torch.full((members,), settings.max_epochs, dtype=torch.long, device=device)
    for epoch in range(1, settings.max_epochs + 1):
        model.train()
        order = torch.stack([torch.randperm(len(train), generator=g) for g in shufflers]).to(device)
        order = train[order[run_of.to(device)]]  # [E, n_train] per-member batch order
        for start in range(0, order.shape[1], settings.batch_size):
            idx = order[:, start : start + settings.batch_size]
            keep = dropout_keep(
                masks, settings.num_runs, run_of, idx.shape[1], settings.hidden_dim, settings.dropout, device
            )
            with autocast(device, settings.precision):
                logits = model(table.rows(probe_of, idx), keep)
            loss = _member_losses(logits, y[idx]).sum()
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        model.eval()
        val_loss, _ = _evaluate(model, table, y, split.val, probe_of, settings.precision)
        active = waited < settings.patience
        improved = active & (val_loss < best_loss)
        best_loss = torch.where(improved, val_loss, best_loss)
        best_epoch = torch.where(improved, epoch, best_epoch)
        waited = torch.where(improved, 0, waited + active.long())
        newly_stopped = active & (waited >= settings.patience)
        stopped_at = torch.where(newly_stopped, epoch, stopped_at)
        with torch.no_grad():
            for p, b in zip(model.parameters(), best):
                b[improved] = p.detach()[improved]
        still = int((waited < settings.patience).sum())
        if on_epoch is not None:
            on_epoch(epoch, still)
        if still == 0:
            break
    return best, best_epoch.cpu(), stopped_at.cpu()


def _member_losses(logits: Tensor, y: Tensor) -> Tensor:
    """Mean cross-entropy of each member [E] (fp32)."""
    members, rows, classes = logits.shape
    loss = F.cross_entropy(logits.float().reshape(-1, classes), y.reshape(-1), reduction="none")
    return loss.view(members, rows).mean(1)


@torch.no_grad()
def _evaluate(
    model: EnsembleMLP, table: FeatureTable, y: Tensor, index: Tensor, probe_of: Tensor, precision: str
) -> tuple[Tensor, Tensor]:
    """Mean loss and accuracy [E] of every member on the rows `index`, in chunks that bound memory."""
    members, index = len(probe_of), index.to(table.device)
    chunk = max(64, (1 << 25) // max(1, members * model.w1.shape[2]))
    loss_sum = torch.zeros(members, device=table.device)
    correct = torch.zeros(members, dtype=torch.long, device=table.device)
    for start in range(0, len(index), chunk):
        idx = index[start : start + chunk].expand(members, -1)
        with autocast(table.device, precision):
            logits = model(table.rows(probe_of, idx)).float()
        target = y[idx]
        loss_sum += _member_losses(logits, target) * idx.shape[1]
        correct += (logits.argmax(-1) == target).sum(1)
    n = max(1, len(index))
    return loss_sum / n, correct.double() / n
