"""Batches of per-sample matrices, the input of every representation function.

One layer's data for B samples is B matrices of shape (m, n): a sample's hidden states (tokens x hidden, padding
rows masked), a LoRA factor (rank x in or out x rank), or a LoRA update B @ A kept in factored form. The
representations ask a `MatrixBatch` for the few quantities they need (row mean, last row, singular values,
random bilinear forms), so a factored product answers them without ever forming the (out x in) matrix.

Singular values of matrices with a short side (LoRA factors, short sequences) come from the eigenvalues of the
float64 Gram matrix of that side: batched matrix products and one small batched symmetric eigensolve. torch's
batched SVD calls cuSOLVER once per matrix on CUDA when a side exceeds 32, and is several times slower on the CPU.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod

import torch
from torch import Tensor

#: Matrices whose shorter side is at most this get exact singular values from their Gram matrix: the usual LoRA
#: ranks (4 to 64) and hidden states of up to 128 tokens. Accuracy does not limit it (see `gram_singular_values`),
#: cost does: the r x r eigenproblems grow as r^3. On an H100, for 128 x 768 hidden states it was 1.9x faster than
#: the randomized SVD and exact where that erred by 5.6e-3 (benchmarks/results/ablation_extraction_H100.md); on
#: the CPU the two cost about the same at 128 (benchmarks/results/ablation_cpu.md).
GRAM_MAX_SIDE = 128
#: torch's CUDA eigh/eigvalsh solve a batch in one cuSOLVER call only for matrices up to 32 x 32, and call the
#: solver once per matrix above that. Between that and HOST_EIGH_MAX the host's LAPACK is faster (H100 with a
#: 16-core host, 24000 LoRA factors of rank 64: 6.1 s on the host, 10.9 s on the GPU); above it the GPU is again
#: (26000 hidden states of 128 tokens: 19.9 s on the GPU, 25.3 s on the host).
CUDA_BATCHED_EIGH_MAX = 32
HOST_EIGH_MAX = 64


def layer_seed(seed: int, layer: str) -> int:
    """A deterministic seed per (run seed, layer name), stable across processes (unlike hash())."""
    return (seed * 1_000_003 + zlib.crc32(layer.encode())) % (2**63)


class MatrixBatch(ABC):
    """B matrices of shape (rows, cols), float32, on one device."""

    def __init__(self, size: int, rows: int, cols: int, row_capacity: int) -> None:
        self.size, self.rows, self.cols = size, rows, cols
        #: the most rows any batch of this layer has (batches of padded sequences are trimmed to their
        #: longest sample): row-indexed random projections are drawn at this size so batches agree.
        self.row_capacity = max(row_capacity, rows)
        self._svals: Tensor | None = None

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @abstractmethod
    def row_mean(self) -> Tensor:
        """[B, cols] mean of each matrix's real rows."""

    @abstractmethod
    def last_row(self) -> Tensor:
        """[B, cols] each matrix's last real row (the last token of a sequence)."""

    @abstractmethod
    def _exact_singular_values(self) -> Tensor: ...

    @abstractmethod
    def bilinear(self, left: Tensor, right: Tensor) -> Tensor:
        """[B, p]: feature j is u_j^T X v_j, with u_j = left[:rows, j] and v_j = right[:, j]."""

    def singular_values(self) -> Tensor:
        """[B, r] every non-trivial singular value in descending order, computed exactly (once per batch)."""
        if self._svals is None:
            self._svals = self._exact_singular_values()
        return self._svals

    def top_singular_values(self, k: int, *, oversample: int, niter: int, seed: int) -> Tensor:
        """[B, k] the k largest singular values (zeros past the matrix rank); exact unless a subclass knows a
        cheaper way. The randomized settings are for subclasses that use them."""
        return _fit_columns(self.singular_values(), k)


class DenseBatch(MatrixBatch):
    """Matrices held as a [B, m, n] tensor; `mask` [B, m] marks real rows (padding rows are zeroed)."""

    def __init__(self, x: Tensor, mask: Tensor | None = None, row_capacity: int = 0) -> None:
        if x.dim() == 2:
            x = x.unsqueeze(1)
        x = x.float()
        if mask is not None:
            mask = mask.to(device=x.device, dtype=torch.bool)
            x = x * mask.unsqueeze(-1)
        super().__init__(x.shape[0], x.shape[1], x.shape[2], row_capacity)
        self.x, self.mask = x, mask

    @property
    def device(self) -> torch.device:
        return self.x.device

    def row_mean(self) -> Tensor:
        if self.mask is None:
            return self.x.mean(1)
        count = self.mask.sum(1, keepdim=True).clamp_min(1)
        return self.x.sum(1) / count

    def last_row(self) -> Tensor:
        if self.mask is None:
            return self.x[:, -1]
        positions = torch.arange(1, self.rows + 1, device=self.device)
        last = (self.mask * positions).argmax(1)  # index of the last real row (works for left padding too)
        return self.x[torch.arange(self.size, device=self.device), last]

    @property
    def _short_side(self) -> int:
        return min(self.row_capacity, self.cols)

    def _exact_singular_values(self) -> Tensor:
        if self._short_side <= GRAM_MAX_SIDE:
            return gram_singular_values(self.x)
        return torch.linalg.svdvals(self.x)

    def top_singular_values(self, k: int, *, oversample: int, niter: int, seed: int) -> Tensor:
        """Exact (from the Gram matrix) when the shorter side is at most GRAM_MAX_SIDE or q = k + oversample
        reaches it; randomized otherwise (`torch.svd_lowrank` with q subspace vectors and `niter` power
        iterations, seeded so that every batch of a layer uses the same test matrix). The choice depends on the
        layer's shape only, so a sample's features do not depend on its batch or on which other representations
        are computed."""
        q = k + oversample
        if self._short_side <= GRAM_MAX_SIDE or q >= self._short_side:
            return super().top_singular_values(k, oversample=oversample, niter=niter, seed=seed)
        # zero rows up to the layer's row capacity: same singular values, and the same random test matrix
        # for every batch whatever its trimmed length
        x = self.x
        if self.rows < self.row_capacity:
            x = torch.nn.functional.pad(x, (0, 0, 0, self.row_capacity - self.rows))
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            return _fit_columns(torch.svd_lowrank(x, q=q, niter=niter)[1], k)

    def bilinear(self, left: Tensor, right: Tensor) -> Tensor:
        return ((self.x @ right) * left[: self.rows]).sum(1)


class LowRankProductBatch(MatrixBatch):
    """LoRA updates X = B @ A from `up` [B, out, r] (lora_B) and `down` [B, r, in] (lora_A), never formed.

    X's singular values come from r x r matrices, exactly, at a cost linear in out and in: for r up to
    GRAM_MAX_SIDE from the factors' float64 Gram matrices (`factored_gram_singular_values`), above it from QR
    factorisations up = Qb Rb and down^T = Qa Ra, X = Qb (Rb Ra^T) Qa^T, as the singular values of the core."""

    def __init__(self, up: Tensor, down: Tensor) -> None:
        super().__init__(up.shape[0], up.shape[1], down.shape[2], up.shape[1])
        self.up, self.down = up.float(), down.float()

    @property
    def device(self) -> torch.device:
        return self.up.device

    def row_mean(self) -> Tensor:
        return (self.up.mean(1, keepdim=True) @ self.down).squeeze(1)

    def last_row(self) -> Tensor:
        return (self.up[:, -1:] @ self.down).squeeze(1)

    def _exact_singular_values(self) -> Tensor:
        if self.up.shape[-1] <= GRAM_MAX_SIDE:
            return factored_gram_singular_values(self.up, self.down)
        r_up = torch.linalg.qr(self.up, mode="r").R
        r_down = torch.linalg.qr(self.down.mT, mode="r").R
        return torch.linalg.svdvals(r_up @ r_down.mT)

    def bilinear(self, left: Tensor, right: Tensor) -> Tensor:
        u_up = self.up.mT @ left[: self.rows]  # [B, r, p]
        down_v = self.down @ right  # [B, r, p]
        return (u_up * down_v).sum(1)


def gram_singular_values(x: Tensor) -> Tensor:
    """[B, min(m, n)] singular values of x [B, m, n] in descending order, as square roots of the eigenvalues of
    the float64 Gram matrix of the shorter side, in the dtype of x.

    Products of float32 entries are exact in float64, so the Gram matrix is accurate to float64 rounding
    (eps = 1.1e-16, times a factor that grows slowly with the long side). Squaring costs relative accuracy only
    for values far below the largest: s_j errs by about eps s_1^2 / s_j, a relative error of eps (s_1 / s_j)^2,
    below float32 rounding while s_1 / s_j < 2e4, and by at most ~sqrt(eps) s_1 = 1e-8 s_1 for the smallest (a
    float32 SVD errs by ~1e-7 s_1)."""
    x64 = x.double()
    gram = x64 @ x64.mT if x.shape[-2] <= x.shape[-1] else x64.mT @ x64
    return _sqrt_eigenvalues(gram).to(x.dtype)


def factored_gram_singular_values(up: Tensor, down: Tensor) -> Tensor:
    """[B, r] singular values of up @ down (up [B, m, r], down [B, r, n]) in descending order, without forming
    the product, in the dtype of up. The non-zero eigenvalues of X^T X = down^T (up^T up) down are those of
    Gu Gd (Gu = up^T up, Gd = down down^T, float64), and with Gu = V L V^T those of the symmetric
    L^1/2 V^T Gd V L^1/2; the error bounds of `gram_singular_values` hold with s_1 replaced by ||up|| ||down||."""
    up64, down64 = up.double(), down.double()
    values, vectors = torch.linalg.eigh(_solver_input(up64.mT @ up64))
    half = (vectors * values.clamp_min(0).sqrt().unsqueeze(-2)).to(up.device)  # V L^1/2
    return _sqrt_eigenvalues(half.mT @ (down64 @ down64.mT) @ half).to(up.dtype)


def _sqrt_eigenvalues(gram: Tensor) -> Tensor:
    """Square roots of the eigenvalues of positive semi-definite [B, r, r], descending (rounding's small negative
    eigenvalues of singular matrices count as 0)."""
    values = torch.linalg.eigvalsh(_solver_input(gram)).to(gram.device)
    return values.flip(-1).clamp_min(0).sqrt()


def _solver_input(symmetric: Tensor) -> Tensor:
    """The matrices to hand to torch's eigensolver: a host copy where the host solves them faster."""
    if symmetric.is_cuda and CUDA_BATCHED_EIGH_MAX < symmetric.shape[-1] <= HOST_EIGH_MAX:
        return symmetric.cpu()
    return symmetric


def _fit_columns(values: Tensor, k: int) -> Tensor:
    if values.shape[1] >= k:
        return values[:, :k]
    return torch.nn.functional.pad(values, (0, k - values.shape[1]))
