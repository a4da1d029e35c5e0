"""Batches of per-sample matrices, the input of every representation function.

One layer's data for B samples is B matrices of shape (m, n): a sample's hidden states (tokens x hidden, padding
rows masked), a LoRA factor (rank x in or out x rank), or a LoRA update B @ A kept in factored form. The
representations ask a `MatrixBatch` for the few quantities they need (row mean, last row, singular values,
random bilinear forms), so a factored product answers them without ever forming the (out x in) matrix.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod

import torch
from torch import Tensor


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

    def _exact_singular_values(self) -> Tensor:
        return torch.linalg.svdvals(self.x)

    def top_singular_values(self, k: int, *, oversample: int, niter: int, seed: int) -> Tensor:
        """Randomized (`torch.svd_lowrank` with q = k + oversample subspace vectors and `niter` power
        iterations, seeded so that every batch of a layer uses the same test matrix) when q is below the
        smaller matrix side, exact otherwise. The choice depends on the layer's shape only, so a sample's
        features do not depend on its batch or on which other representations are computed."""
        q = k + oversample
        if q >= min(self.row_capacity, self.cols):
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

    With QR factorisations up = Qb Rb and down^T = Qa Ra, X = Qb (Rb Ra^T) Qa^T, so X's singular values are those
    of the r x r core: exact, at a cost linear in out and in."""

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
        r_up = torch.linalg.qr(self.up).R
        r_down = torch.linalg.qr(self.down.mT).R
        return torch.linalg.svdvals(r_up @ r_down.mT)

    def bilinear(self, left: Tensor, right: Tensor) -> Tensor:
        u_up = self.up.mT @ left[: self.rows]  # [B, r, p]
        down_v = self.down @ right  # [B, r, p]
        return (u_up * down_v).sum(1)


def _fit_columns(values: Tensor, k: int) -> Tensor:
    if values.shape[1] >= k:
        return values[:, :k]
    return torch.nn.functional.pad(values, (0, k - values.shape[1]))
