"""Representation functions: what a probe sees of one layer of one sample.

A base representation maps a `MatrixBatch` (B matrices of one layer) to features [B, f], batched on the device
of the batch. Every base also has two all-layers variants, applied to the layers being probed:

- ``<base>_all_layers``: one probe on the concatenation of the base features of every layer;
- ``<base>_cumulative``: at layer l, one probe on the concatenation of layers 0..l (what is known by layer l).

The names are also listed in core/profiles/ablation.py, so that profiles validate without importing torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from gpuopt_tui.jobs.ablation.matrices import MatrixBatch, layer_seed


@dataclass(frozen=True)
class FeatureSettings:
    top_k: int = 10
    svd_oversample: int = 10
    svd_niter: int = 4
    projection_dim: int = 10
    seed: int = 0


@dataclass(frozen=True)
class Base:
    name: str
    help: str
    compute: Callable[[MatrixBatch, FeatureSettings, str], Tensor]  # (batch, settings, layer name)
    uses: tuple[str, ...]  # the FeatureSettings fields its output depends on (part of the cache key)
    #: part of the cache key: bumped when the output changes for the same inputs and settings, so that features
    #: cached by an earlier version are computed again (2: singular values from the float64 Gram matrix)
    version: int = 1

    def settings_key(self, settings: FeatureSettings) -> dict[str, int]:
        return {name: getattr(settings, name) for name in self.uses}


def spectrum_statistics(svals: Tensor) -> Tensor:
    """[B, 5] from singular values [B, r]: effective rank (Roy & Vetterli: exp of the entropy of s / sum(s)),
    stable rank (||X||_F^2 / ||X||_2^2), spectral, Frobenius and nuclear norms. A zero matrix gives zeros."""
    nuclear = svals.sum(1)
    spectral = svals[:, 0]
    frobenius = svals.square().sum(1).sqrt()
    p = svals / nuclear.clamp_min(torch.finfo(svals.dtype).tiny).unsqueeze(1)
    entropy = -(p * torch.log(p.clamp_min(torch.finfo(svals.dtype).tiny))).sum(1)
    effective_rank = torch.where(nuclear > 0, entropy.exp(), torch.zeros_like(entropy))
    stable_rank = torch.where(spectral > 0, frobenius.square() / spectral.square().clamp_min(1e-30), 0.0)
    return torch.stack([effective_rank, stable_rank, spectral, frobenius, nuclear], dim=1)


def _svd_topk(batch: MatrixBatch, s: FeatureSettings, layer: str) -> Tensor:
    return batch.top_singular_values(
        s.top_k, oversample=s.svd_oversample, niter=s.svd_niter, seed=layer_seed(s.seed, layer)
    )


def _random_projection(batch: MatrixBatch, s: FeatureSettings, layer: str) -> Tensor:
    # Rank-one Gaussian test directions: feature j = u_j^T X v_j, E[f_j^2] = ||X||_F^2. They need O(p (m + n))
    # memory where a dense projection of the flattened matrix needs O(p m n), and they apply to factored
    # matrices too. Drawn on the CPU so that every device gets the same directions.
    gen = torch.Generator().manual_seed(layer_seed(s.seed, layer))
    left = torch.randn(batch.row_capacity, s.projection_dim, generator=gen)
    right = torch.randn(batch.cols, s.projection_dim, generator=gen)
    return batch.bilinear(left.to(batch.device), right.to(batch.device))


BASES: dict[str, Base] = {
    b.name: b
    for b in (
        Base("mean_pool", "mean of the rows (tokens) of each sample's matrix", lambda b, s, n: b.row_mean(), ()),
        Base("last_token", "last real row (token) of each sample's matrix", lambda b, s, n: b.last_row(), ()),
        Base(
            "svd_topk",
            "top_k singular values (exact for LoRA products and a shorter side up to 64, else torch.svd_lowrank)",
            _svd_topk,
            ("top_k", "svd_oversample", "svd_niter", "seed"),
            version=2,
        ),
        Base(
            "spectrum_stats",
            "effective rank, stable rank, spectral, Frobenius and nuclear norms (exact spectrum)",
            lambda b, s, n: spectrum_statistics(b.singular_values()),
            (),
            version=2,
        ),
        Base(
            "random_projection",
            "projection_dim random bilinear projections (a baseline without spectral structure)",
            _random_projection,
            ("projection_dim", "seed"),
        ),
    )
}
