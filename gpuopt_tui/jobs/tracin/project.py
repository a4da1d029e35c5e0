"""Seeded random projection of per-example gradients, the same for training and test examples.

Each parameter tensor is projected on its own, to at most `dim` numbers. A matrix-shaped gradient G (m x n)
becomes A^T G B with A (m x k1) and B (n x k2) random, so the projection of a Linear layer's gradient
g a^T is (A^T g)(B^T a)^T and never needs the full outer product; vectors use one matrix. Every factor has
orthonormal columns scaled by sqrt(rows / columns), so E[<Pg, Pg'>] = <g, g'>; a factor as wide as its
input is a rotation, so a `dim` at least as large as every parameter tensor reproduces exact scores.
"""

from __future__ import annotations

import functools
import math
import zlib

import torch
from torch import Tensor


def factor_dims(m: int, n: int, dim: int) -> tuple[int, int]:
    """Projected sizes (k1, k2) of an m x n gradient for a budget of `dim` numbers: k1 * k2 <= dim."""
    if m * n <= dim:
        return m, n
    k1 = min(m, max(1, math.isqrt(dim)))
    k2 = min(n, max(1, dim // k1))
    if k2 == n:
        k1 = min(m, max(1, dim // n))
    return k1, k2


class Projector:
    """Projection factors made on demand from (seed, parameter name, axis) and kept on `device`."""

    def __init__(self, dim: int, seed: int, device: torch.device, dtype: torch.dtype) -> None:
        if dim < 1:
            raise ValueError("projection dim must be at least 1")
        self.dim = dim
        self.seed = seed
        self.device = device
        self.dtype = dtype
        self._factors: dict[tuple[str, int, int, int], Tensor] = {}

    def factor(self, name: str, axis: int, rows: int, cols: int) -> Tensor:
        """A (rows x cols) factor with orthonormal columns times sqrt(rows / cols)."""
        key = (name, axis, rows, cols)
        cached = self._factors.get(key)
        if cached is None:
            cached = _orthonormal(self.seed, name, axis, rows, cols, self.dtype).to(self.device)
            self._factors[key] = cached
        return cached

    def dense(self, name: str, grad: Tensor) -> Tensor:
        """[B, *shape] per-example gradients -> [B, k] (vectors) or [B, k1 * k2] (everything else)."""
        batch = grad.shape[0]
        if grad.dim() <= 2:
            vec = grad.reshape(batch, -1)
            m = vec.shape[1]
            return vec @ self.factor(name, 0, m, min(m, self.dim))
        mat = grad.reshape(batch, grad.shape[1], -1)
        m, n = mat.shape[1:]
        k1, k2 = factor_dims(m, n, self.dim)
        out = torch.einsum("bmn,mk,nl->bkl", mat, self.factor(name, 0, m, k1), self.factor(name, 1, n, k2))
        return out.reshape(batch, -1)

    def outer(self, name: str, g: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
        """The projection of per-example outer products g a^T ([B, m] x [B, n]), kept factored."""
        m, n = g.shape[1], a.shape[1]
        k1, k2 = factor_dims(m, n, self.dim)
        return g @ self.factor(name, 0, m, k1), a @ self.factor(name, 1, n, k2)

    def size(self, shape: tuple[int, ...]) -> int:
        """How many numbers a parameter of `shape` projects to."""
        if len(shape) <= 1:
            return min(math.prod(shape), self.dim)
        k1, k2 = factor_dims(shape[0], math.prod(shape[1:]), self.dim)
        return k1 * k2


@functools.lru_cache(maxsize=1024)
def _orthonormal(seed: int, name: str, axis: int, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
    """A seeded (rows x cols) factor on the CPU. Remembered for the process: the Gaussian draw and QR of a large
    factor (an embedding's vocabulary side) take tens of milliseconds, which every run scoring a new test set
    would pay again."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}:{axis}".encode()))
    gauss = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    q, _ = torch.linalg.qr(gauss)
    return (q * math.sqrt(rows / cols)).to(dtype)
