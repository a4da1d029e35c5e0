"""Representation functions against float64 references computed independently (numpy / dense products)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpuopt_tui.core.profiles.ablation import BASE_REPRESENTATIONS, REPRESENTATIONS, split_representation
from gpuopt_tui.jobs.ablation.matrices import DenseBatch, LowRankProductBatch, layer_seed
from gpuopt_tui.jobs.ablation.representations import BASES, FeatureSettings, spectrum_statistics

torch.set_num_threads(1)


def _matrices(batch: int, m: int, n: int, decay: float, seed: int = 0) -> torch.Tensor:
    """[batch, m, n] float64 with random singular vectors and singular values j^-decay."""
    gen = torch.Generator().manual_seed(seed)
    r = min(m, n)
    u = torch.linalg.qr(torch.randn(batch, m, r, generator=gen, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(batch, n, r, generator=gen, dtype=torch.float64)).Q
    s = torch.arange(1, r + 1, dtype=torch.float64) ** -decay
    return (u * s) @ v.mT


def _relative_topk_error(x: torch.Tensor, k: int, oversample: int, niter: int) -> float:
    reference = np.linalg.svd(x.numpy(), compute_uv=False)[:, :k]
    got = DenseBatch(x.float()).top_singular_values(k, oversample=oversample, niter=niter, seed=1).double().numpy()
    return float(np.max(np.abs(got - reference) / reference))


# Shapes: a sequence's hidden states (128 tokens x 768, BERT-base) and a LoRA factor of rank 64 over a
# 4096-wide projection, with the slowly decaying spectra (j^-0.5, j^-1) of real activations and weights.
# Tolerance 1e-2 relative on each of the top 10 values: the defaults (oversample 10, 4 power iterations)
# measure <= 2e-3 on these; a flat spectrum (Gaussian noise) is the randomized SVD's worst case (~3.5e-2).
@pytest.mark.parametrize(("m", "n"), [(128, 768), (64, 4096)])
@pytest.mark.parametrize("decay", [0.5, 1.0])
def test_svd_lowrank_topk_matches_full_svd(m: int, n: int, decay: float) -> None:
    s = FeatureSettings()
    x = _matrices(4, m, n, decay)
    assert s.top_k + s.svd_oversample < min(m, n)  # the randomized path is the one under test
    assert _relative_topk_error(x, s.top_k, s.svd_oversample, s.svd_niter) < 1e-2


def test_svd_lowrank_without_oversampling_misses_the_tolerance() -> None:
    """Why the defaults oversample: q = k with 2 power iterations errs by more than 10% on the k-th value."""
    assert _relative_topk_error(_matrices(4, 128, 768, 0.5), 10, 0, 2) > 0.1


def test_svd_lowrank_on_a_flat_spectrum_stays_within_five_percent() -> None:
    x = torch.randn(4, 128, 768, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert _relative_topk_error(x, 10, 10, 4) < 5e-2


def test_small_matrices_use_exact_singular_values_padded_with_zeros() -> None:
    x = _matrices(6, 8, 64, 0.7)  # LoRA-A-like rank 8: q = k + oversample >= 8, so exact
    got = DenseBatch(x.float()).top_singular_values(10, oversample=10, niter=4, seed=0)
    reference = np.linalg.svd(x.numpy(), compute_uv=False)
    assert got.shape == (6, 10)
    np.testing.assert_allclose(got[:, :8].double().numpy(), reference, rtol=1e-5)
    assert torch.all(got[:, 8:] == 0)


def test_factored_lora_product_matches_the_dense_product() -> None:
    gen = torch.Generator().manual_seed(0)
    up, down = torch.randn(5, 96, 8, generator=gen), torch.randn(5, 8, 80, generator=gen)
    product = (up.double() @ down.double()).numpy()
    batch = LowRankProductBatch(up, down)
    np.testing.assert_allclose(
        batch.singular_values().double().numpy(), np.linalg.svd(product, compute_uv=False)[:, :8], rtol=1e-4
    )
    np.testing.assert_allclose(batch.row_mean().numpy(), product.mean(1), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(batch.last_row().numpy(), product[:, -1], rtol=1e-4, atol=1e-5)
    left, right = torch.randn(96, 3, generator=gen), torch.randn(80, 3, generator=gen)
    expected = np.einsum("bmn,mp,np->bp", product, left.double().numpy(), right.double().numpy())
    np.testing.assert_allclose(batch.bilinear(left, right).numpy(), expected, rtol=1e-4, atol=1e-3)
    dense = DenseBatch(torch.from_numpy(product).float())
    settings = FeatureSettings(top_k=12)
    for name in ("svd_topk", "spectrum_stats", "random_projection"):
        fact, full = (BASES[name].compute(b, settings, "layer.2") for b in (batch, dense))
        np.testing.assert_allclose(fact.numpy(), full.numpy(), rtol=1e-3, atol=1e-3)


def test_spectrum_statistics_against_numpy() -> None:
    x = _matrices(3, 20, 30, 0.8, seed=5).numpy() * np.array([1.0, 3.0, 0.5])[:, None, None]
    s = np.linalg.svd(x, compute_uv=False)
    p = s / s.sum(1, keepdims=True)
    expected = np.stack(
        [
            np.exp(-(p * np.log(p)).sum(1)),
            (s**2).sum(1) / s[:, 0] ** 2,
            s[:, 0],
            np.linalg.norm(x, axis=(1, 2)),
            s.sum(1),
        ],
        axis=1,
    )
    got = spectrum_statistics(torch.from_numpy(s)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-10)
    assert torch.all(spectrum_statistics(torch.zeros(2, 4)) == 0)  # zero matrices: zeros, not NaN


def test_masked_pooling_matches_a_loop_over_real_tokens() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 7, 5, generator=gen)
    lengths = [7, 3, 1, 5]
    mask = torch.tensor([[1] * n + [0] * (7 - n) for n in lengths])
    batch = DenseBatch(x, mask)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(batch.row_mean()[i], x[i, :n].mean(0))
        torch.testing.assert_close(batch.last_row()[i], x[i, n - 1])
        np.testing.assert_allclose(
            batch.singular_values()[i, : min(n, 5)].numpy(),
            np.linalg.svd(x[i, :n].double().numpy(), compute_uv=False),
            rtol=1e-4,
            atol=1e-5,
        )
    left_padded = DenseBatch(x, mask.flip(1))  # left padding: the last real row is the last row
    torch.testing.assert_close(left_padded.last_row(), x[:, -1])


def test_features_do_not_depend_on_batching_or_trimmed_padding() -> None:
    """A sample's features are the same alone or in a batch, and whatever the batch's padded length."""
    x = _matrices(6, 40, 64, 0.5, seed=2).float()
    lengths = torch.tensor([40, 30, 12, 40, 25, 33])
    mask = torch.arange(40).unsqueeze(0) < lengths.unsqueeze(1)
    settings = FeatureSettings(top_k=5, svd_oversample=3, svd_niter=2)  # q = 8 < 40: randomized path
    whole = DenseBatch(x, mask, row_capacity=40)
    trimmed = DenseBatch(x[2:3, :12], mask[2:3, :12], row_capacity=40)
    for name in BASE_REPRESENTATIONS:
        a = BASES[name].compute(whole, settings, "layer.1")[2]
        b = BASES[name].compute(trimmed, settings, "layer.1")[0]
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_random_projection_is_seeded_per_layer_and_matches_a_naive_sum() -> None:
    x = torch.randn(3, 6, 9, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    settings = FeatureSettings(projection_dim=4, seed=7)
    got = BASES["random_projection"].compute(DenseBatch(x), settings, "layer.0")
    gen = torch.Generator().manual_seed(layer_seed(7, "layer.0"))
    u, v = torch.randn(6, 4, generator=gen).double(), torch.randn(9, 4, generator=gen).double()
    naive = torch.tensor(
        [[float(u[:, j] @ x[b].float().double() @ v[:, j]) for j in range(4)] for b in range(3)], dtype=torch.float64
    )
    torch.testing.assert_close(got.double(), naive, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, BASES["random_projection"].compute(DenseBatch(x), settings, "layer.0"))
    assert not torch.allclose(got, BASES["random_projection"].compute(DenseBatch(x), settings, "layer.1"))


def test_every_profile_name_has_an_implementation() -> None:
    assert tuple(BASES) == BASE_REPRESENTATIONS
    assert len(REPRESENTATIONS) == 3 * len(BASE_REPRESENTATIONS)
    assert split_representation("svd_topk_cumulative") == ("svd_topk", "_cumulative")
    assert split_representation("mean_pool_all_layers") == ("mean_pool", "_all_layers")
    with pytest.raises(ValueError):
        split_representation("svd_top")
