"""Representation functions against float64 references computed independently (numpy / dense products)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpuopt_tui.core.caches.features import cache_key
from gpuopt_tui.core.profiles.ablation import BASE_REPRESENTATIONS, REPRESENTATIONS, split_representation
from gpuopt_tui.jobs.ablation.features import feature_key
from gpuopt_tui.jobs.ablation.inputs import synthetic_source
from gpuopt_tui.jobs.ablation.matrices import (
    CUDA_BATCHED_EIGH_MAX,
    GRAM_MAX_SIDE,
    HOST_EIGH_MAX,
    DenseBatch,
    LowRankProductBatch,
    factored_gram_singular_values,
    gram_singular_values,
    layer_seed,
)
from gpuopt_tui.jobs.ablation.representations import BASES, FeatureSettings, spectrum_statistics
from gpuopt_tui.jobs.ablation.synthetic import SyntheticSpec

torch.set_num_threads(1)


def _matrices(batch: int, m: int, n: int, decay: float, seed: int = 0) -> torch.Tensor:
    """[batch, m, n] float64 with random singular vectors and singular values j^-decay."""
    return _with_spectrum(batch, m, n, torch.arange(1, min(m, n) + 1, dtype=torch.float64) ** -decay, seed)


def _with_spectrum(batch: int, m: int, n: int, s: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """[batch, m, n] float64 with random singular vectors and singular values s [min(m, n)]."""
    gen = torch.Generator().manual_seed(seed)
    r = min(m, n)
    u = torch.linalg.qr(torch.randn(batch, m, r, generator=gen, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(batch, n, r, generator=gen, dtype=torch.float64)).Q
    return (u * s) @ v.mT


def _relative_topk_error(x: torch.Tensor, k: int, oversample: int, niter: int) -> float:
    reference = np.linalg.svd(x.numpy(), compute_uv=False)[:, :k]
    got = DenseBatch(x.float()).top_singular_values(k, oversample=oversample, niter=niter, seed=1).double().numpy()
    return float(np.max(np.abs(got - reference) / reference))


def _spectrum(kind: str, r: int) -> torch.Tensor:
    j = torch.arange(1, r + 1, dtype=torch.float64)
    if kind == "slow":  # activations and trained weights: j^-0.5
        return j**-0.5
    if kind == "wide":  # s_1 / s_10 = 3e4, s_1 / s_r down to 1e-7 and below
        return 10 ** (-(j - 1) / 2)
    rank_deficient = j**-1.0
    rank_deficient[r // 3 :] = 0
    return rank_deficient


# Exact singular values from the float64 Gram matrix (see gram_singular_values): float32 inputs, compared with
# numpy's float64 SVD of the same float32 matrices. Tolerances: 1e-6 relative on each of the top 10 non-zero
# values (measured <= 8e-8 on these, the float32 rounding of the result, where torch.linalg.svdvals in float32 errs
# by up to 3e-4 on the wide spectrum), and 1e-7 s_1 absolute on every value, the zeros of rank-deficient matrices
# included (measured <= 3e-8 s_1).
@pytest.mark.parametrize(("m", "n"), [(16, 1024), (64, 4096), (128, 768), (1024, 48)])
@pytest.mark.parametrize("spectrum", ["slow", "wide", "rank_deficient"])
def test_gram_singular_values_match_float64_svd(m: int, n: int, spectrum: str) -> None:
    x = _with_spectrum(3, m, n, _spectrum(spectrum, min(m, n)), seed=m + n).float()
    reference = np.linalg.svd(x.double().numpy(), compute_uv=False)
    got = gram_singular_values(x)
    assert got.dtype == torch.float32 and got.shape == reference.shape
    got = got.double().numpy()
    s1 = reference[:, :1]
    assert np.max(np.abs(got - reference) / s1) < 1e-7
    top, ref_top = got[:, :10], reference[:, :10]
    nonzero = ref_top > 1e-6 * s1
    assert np.max(np.abs(top - ref_top)[nonzero] / ref_top[nonzero]) < 1e-6


def test_gram_singular_values_of_zero_tiny_and_huge_matrices() -> None:
    gen = torch.Generator().manual_seed(7)
    assert torch.equal(gram_singular_values(torch.zeros(2, 16, 64)), torch.zeros(2, 16))
    for scale in (1e-20, 1e20):  # squares stay far inside float64's range
        x = torch.randn(2, 16, 64, generator=gen) * scale
        reference = np.linalg.svd(x.double().numpy(), compute_uv=False)
        np.testing.assert_allclose(gram_singular_values(x).double().numpy(), reference, rtol=1e-6)


def test_factored_lora_product_singular_values_match_the_dense_svd() -> None:
    """LoRA updates B @ A of rank 16 (1024 x 1024) and 48, one with half of B's columns zero (rank 8) and one
    with B = 0 (a freshly initialised adapter): top 10 within 1e-6 relative, all values within 1e-7 of
    ||B|| ||A||."""
    gen = torch.Generator().manual_seed(3)
    for out, r, n in ((1024, 16, 1024), (768, 48, 512)):
        up, down = torch.randn(3, out, r, generator=gen), torch.randn(3, r, n, generator=gen) / n**0.5
        up[1, :, r // 2 :] = 0
        up[2] = 0
        dense = up.double().numpy() @ down.double().numpy()
        reference = np.linalg.svd(dense, compute_uv=False)[:, :r]
        got = LowRankProductBatch(up, down).singular_values()
        assert got.shape == (3, r)
        got = got.double().numpy()
        scale = np.linalg.norm(up.double().numpy(), 2, axis=(1, 2)) * np.linalg.norm(down.numpy(), 2, axis=(1, 2))
        assert np.all(np.abs(got - reference) <= 1e-7 * scale[:, None])
        nonzero = reference[:, :10] > 1e-6 * reference[:, :1]
        assert np.max(np.abs(got[:, :10] - reference[:, :10])[nonzero] / reference[:, :10][nonzero]) < 1e-6
        assert torch.equal(factored_gram_singular_values(up[2:], down[2:]), torch.zeros(1, r))


def test_lora_products_above_the_gram_limit_use_the_qr_core() -> None:
    gen = torch.Generator().manual_seed(4)
    r = GRAM_MAX_SIDE + 8
    up, down = torch.randn(2, 200, r, generator=gen), torch.randn(2, r, 160, generator=gen)
    reference = np.linalg.svd(up.double().numpy() @ down.double().numpy(), compute_uv=False)[:, :r]
    got = LowRankProductBatch(up, down).singular_values()
    assert got.shape == (2, r)
    np.testing.assert_allclose(got.double().numpy(), reference, rtol=1e-4)


def test_the_short_side_decides_between_exact_and_randomized() -> None:
    """Up to GRAM_MAX_SIDE rows the top k are the exact values even where q = k + oversample is below the short
    side; above it the randomized SVD gives (slightly) different ones."""
    settings = dict(oversample=3, niter=1, seed=0)
    small = DenseBatch(_matrices(2, GRAM_MAX_SIDE, 200, 0.5).float())
    torch.testing.assert_close(small.top_singular_values(5, **settings), gram_singular_values(small.x)[:, :5])
    large = DenseBatch(_matrices(2, GRAM_MAX_SIDE + 1, 200, 0.5).float())
    assert not torch.allclose(large.top_singular_values(5, **settings), large.singular_values()[:, :5], rtol=1e-5)


# Randomized path. Shapes: a sequence's hidden states (256 tokens x 768, BERT-base) and a matrix of rank 192 over a
# 4096-wide projection, with the slowly decaying spectra (j^-0.5, j^-1) of real activations and weights.
# Tolerance 1e-2 relative on each of the top 10 values: the defaults (oversample 10, 4 power iterations)
# measure <= 2e-3 on these; a flat spectrum (Gaussian noise) is the randomized SVD's worst case (~3.5e-2).
@pytest.mark.parametrize(("m", "n"), [(256, 768), (192, 4096)])
@pytest.mark.parametrize("decay", [0.5, 1.0])
def test_svd_lowrank_topk_matches_full_svd(m: int, n: int, decay: float) -> None:
    s = FeatureSettings()
    x = _matrices(4, m, n, decay)
    assert min(m, n) > GRAM_MAX_SIDE  # the randomized path is the one under test
    assert _relative_topk_error(x, s.top_k, s.svd_oversample, s.svd_niter) < 1e-2


def test_svd_lowrank_without_oversampling_misses_the_tolerance() -> None:
    """Why the defaults oversample: q = k with 2 power iterations errs by more than 10% on the k-th value."""
    assert _relative_topk_error(_matrices(4, 256, 768, 0.5), 10, 0, 2) > 0.1


def test_svd_lowrank_on_a_flat_spectrum_stays_within_five_percent() -> None:
    x = torch.randn(4, 256, 768, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
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


@pytest.mark.parametrize("rows", [40, 80])  # the exact (Gram) path and the randomized one (q = 8 < 80)
def test_features_do_not_depend_on_batching_or_trimmed_padding(rows: int) -> None:
    """A sample's features are the same alone or in a batch, and whatever the batch's padded length."""
    x = _matrices(6, rows, 96, 0.5, seed=2).float()
    lengths = torch.tensor([rows, 30, 12, rows, 25, 33])
    mask = torch.arange(rows).unsqueeze(0) < lengths.unsqueeze(1)
    settings = FeatureSettings(top_k=5, svd_oversample=3, svd_niter=2)
    whole = DenseBatch(x, mask, row_capacity=rows)
    trimmed = DenseBatch(x[2:3, :12], mask[2:3, :12], row_capacity=rows)
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


def test_cache_keys_of_changed_representations_differ_from_earlier_versions() -> None:
    """svd_topk and spectrum_stats now come from the Gram matrix (version 2): their features cached by version 1
    are not reused; the unchanged representations keep their keys (and their cached entries)."""
    source = synthetic_source(SyntheticSpec(samples=20, layers=2, signal_layer=1, rank=2, dim=4))
    settings = FeatureSettings()
    for name, base in BASES.items():
        version_1 = cache_key(
            {
                "input": source.fingerprint("layer.1"),
                "samples": source.samples,
                "representation": name,
                "version": 1,
                "settings": base.settings_key(settings),
            }
        )
        changed = feature_key(source, name, "layer.1", settings) != version_1
        assert changed == (name in ("svd_topk", "spectrum_stats")), name


@pytest.mark.gpu
# batched on the device / solved on the host / one at a time on the device
@pytest.mark.parametrize("short", [16, CUDA_BATCHED_EIGH_MAX + 16, HOST_EIGH_MAX + 32])
def test_gram_paths_on_cuda_match_the_cpu(short: int) -> None:
    cuda = torch.device("cuda")
    x = _matrices(64, short, 1024, 0.5).float()
    torch.testing.assert_close(gram_singular_values(x.to(cuda)).cpu(), gram_singular_values(x), rtol=1e-6, atol=1e-7)
    gen = torch.Generator().manual_seed(5)
    up, down = torch.randn(64, 512, short, generator=gen), torch.randn(64, short, 768, generator=gen)
    on_cuda = LowRankProductBatch(up.to(cuda), down.to(cuda)).singular_values().cpu()
    torch.testing.assert_close(on_cuda, LowRankProductBatch(up, down).singular_values(), rtol=1e-6, atol=1e-5)
