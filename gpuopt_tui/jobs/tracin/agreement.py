"""How well two TracIn score matrices agree on the ranking of training examples (e.g. last layers or a
projection against the exact all-parameter scores, or bf16 against fp32)."""

from __future__ import annotations

from torch import Tensor


def rank_correlation(a: Tensor, b: Tensor) -> float:
    """Spearman correlation between a and b ([n_test, n_train]) across training examples, per test example,
    averaged over test examples. Ties are ranked by position (scores are continuous)."""
    if a.shape != b.shape:
        raise ValueError(f"score matrices differ in shape: {tuple(a.shape)} and {tuple(b.shape)}")
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(1, keepdim=True), rb - rb.mean(1, keepdim=True)
    return float(((ra * rb).sum(1) / (ra.norm(dim=1) * rb.norm(dim=1))).mean())


def _ranks(x: Tensor) -> Tensor:
    return x.double().argsort(1).argsort(1).double()


def top_k_overlap(a: Tensor, b: Tensor, k: int = 10) -> float:
    """Share of each test example's k highest-scoring training examples that a and b have in common, averaged."""
    if a.shape != b.shape:
        raise ValueError(f"score matrices differ in shape: {tuple(a.shape)} and {tuple(b.shape)}")
    k = min(k, a.shape[1])
    top_a, top_b = a.topk(k, 1).indices, b.topk(k, 1).indices
    shared = (top_a[:, :, None] == top_b[:, None, :]).any(2).sum(1)
    return float(shared.double().mean() / k) if k else 1.0
