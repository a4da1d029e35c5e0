"""Integration rules of the path integral: where the steps lie on [0, 1] and how much each one weighs.

Every rule's weights sum to 1, so a function that is linear along the path is integrated exactly
(completeness holds to rounding). Note that this makes `riemann_trapezoid` use 1/(n-1) with halved ends;
Captum's version uses 1/n, whose weights sum to 1 - 1/n. `clenshaw_curtis` (not in Captum) puts its n points at
the Chebyshev extrema (both ends included); it converges about as fast as Gauss-Legendre on smooth paths and its
point sets nest (2n - 1 points hold all n), which is what `n_steps = "auto"` refines with (adaptive.py).
"""

from __future__ import annotations

import numpy as np

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.attribution import IG_METHODS as METHODS

# Order of the error in 1/n of each rule on smooth integrands (used to suggest a step count).
CONVERGENCE_ORDER = {
    "riemann_left": 1,
    "riemann_right": 1,
    "riemann_middle": 2,
    "riemann_trapezoid": 2,
    "gausslegendre": 2,  # converges faster in theory; 2 keeps step suggestions on the safe side
    "clenshaw_curtis": 2,  # likewise
}
_LEGGAUSS_MAX = 256  # numpy's eigenvalue method costs O(n^3) (0.6 s at 2000): Newton is O(n^2)


def step_rule(method: str, n_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Alphas in [0, 1] and their weights (float64, each of length `n_steps`, weights summing to 1)."""
    n = int(n_steps)
    if n < 1:
        raise UserError(f"n_steps must be at least 1, got {n_steps}")
    if method == "riemann_left":
        return np.arange(n) / n, np.full(n, 1.0 / n)
    if method == "riemann_right":
        return np.arange(1, n + 1) / n, np.full(n, 1.0 / n)
    if method == "riemann_middle":
        return (np.arange(n) + 0.5) / n, np.full(n, 1.0 / n)
    if method == "riemann_trapezoid":
        if n < 2:
            raise UserError("method riemann_trapezoid needs n_steps >= 2 (both ends of the path)")
        weights = np.full(n, 1.0 / (n - 1))
        weights[[0, -1]] *= 0.5
        return np.linspace(0.0, 1.0, n), weights
    if method == "gausslegendre":
        nodes, weights = np.polynomial.legendre.leggauss(n) if n <= _LEGGAUSS_MAX else gauss_legendre_newton(n)
        return 0.5 * (nodes + 1.0), 0.5 * weights
    if method == "clenshaw_curtis":
        if n < 2:
            raise UserError("method clenshaw_curtis needs n_steps >= 2 (both ends of the path)")
        return clenshaw_curtis(n - 1)
    raise UserError(f"unknown integration method {method!r}; expected one of {', '.join(METHODS)}")


def clenshaw_curtis(intervals: int) -> tuple[np.ndarray, np.ndarray]:
    """The Clenshaw-Curtis rule of `intervals` + 1 points on [0, 1]: alphas (1 - cos(j pi / N)) / 2 in increasing
    order and their weights (Waldvogel's explicit sum; O(N^2), 30 ms at N = 2048)."""
    n = int(intervals)
    theta = np.pi * np.arange(n + 1) / n
    weights = np.zeros(n + 1)
    inner = np.ones(n - 1)
    k = np.arange(1, n // 2 + 1 if n % 2 else n // 2)  # k = 1 .. floor((N-1)/2)
    inner -= (2.0 * np.cos(2.0 * np.outer(k, theta[1:-1])) / (4.0 * k * k - 1.0)[:, None]).sum(0)
    if n % 2 == 0:
        weights[0] = weights[n] = 1.0 / (n * n - 1.0)
        inner -= np.cos(n * theta[1:-1]) / (n * n - 1.0)
    else:
        weights[0] = weights[n] = 1.0 / (n * n)
    weights[1:-1] = 2.0 * inner / n
    return 0.5 * (1.0 - np.cos(theta)), 0.5 * weights


def gauss_legendre_newton(n: int, max_iter: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Gauss-Legendre nodes and weights on [-1, 1] by Newton's method on P_n (O(n^2) work, O(n) memory).

    Starts from the classical cosine estimates of the roots; the Legendre recurrence evaluates P_n and
    P_{n-1} at all of them at once. Only the positive half is computed; the rule is symmetric.
    """
    half = (n + 1) // 2
    i = np.arange(1, half + 1)
    x = np.cos(np.pi * (i - 0.25) / (n + 0.5))
    for _ in range(max_iter):
        p_n, p_prev = _legendre_pair(n, x)
        dp = n * (x * p_n - p_prev) / (x * x - 1.0)
        step = p_n / dp
        x = x - step
        if np.max(np.abs(step)) < 1e-15:
            break
    p_n, p_prev = _legendre_pair(n, x)
    dp = n * (x * p_n - p_prev) / (x * x - 1.0)
    w = 2.0 / ((1.0 - x * x) * dp * dp)
    # x holds the roots in descending order; mirror them (a middle root at 0 appears once).
    mirrored = n - half
    nodes = np.concatenate([-x[:mirrored], x[::-1]])
    weights = np.concatenate([w[:mirrored], w[::-1]])
    return nodes, weights


def _legendre_pair(n: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """P_n(x) and P_{n-1}(x) by the three-term recurrence."""
    p_prev, p = np.ones_like(x), x.copy()
    for k in range(2, n + 1):
        p_prev, p = p, ((2 * k - 1) * x * p - (k - 1) * p_prev) / k
    return p, p_prev
