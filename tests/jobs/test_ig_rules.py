"""Integration rules, completeness on models whose path integral is known, deltas and chunk planning."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from captum.attr import IntegratedGradients

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.attribution import METHODS, ChunkPlanner, IGOptions, integrated_gradients, step_rule
from gpuopt_tui.jobs.attribution.deltas import delta_summary
from gpuopt_tui.jobs.attribution.rules import gauss_legendre_newton

CPU = torch.device("cpu")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", [2, 3, 50, 2001])
def test_weights_sum_to_one_and_alphas_lie_on_the_path(method: str, n: int) -> None:
    alphas, weights = step_rule(method, n)
    assert alphas.shape == weights.shape == (n,)
    assert abs(weights.sum() - 1.0) < 1e-12
    assert (weights > 0).all()
    assert alphas.min() >= 0.0 and alphas.max() <= 1.0
    assert np.all(np.diff(alphas) > 0)


def test_rule_alphas() -> None:
    assert np.allclose(step_rule("riemann_left", 4)[0], [0, 0.25, 0.5, 0.75])
    assert np.allclose(step_rule("riemann_right", 4)[0], [0.25, 0.5, 0.75, 1])
    assert np.allclose(step_rule("riemann_middle", 4)[0], [0.125, 0.375, 0.625, 0.875])
    alphas, weights = step_rule("riemann_trapezoid", 5)
    assert np.allclose(alphas, [0, 0.25, 0.5, 0.75, 1]) and np.allclose(weights, [0.125, 0.25, 0.25, 0.25, 0.125])


@pytest.mark.parametrize("n", [1, 2, 5, 33, 300])
def test_newton_gauss_legendre_matches_numpy(n: int) -> None:
    nodes, weights = gauss_legendre_newton(n)
    ref_nodes, ref_weights = np.polynomial.legendre.leggauss(n)
    assert np.abs(nodes - ref_nodes).max() < 1e-13
    assert np.abs(weights - ref_weights).max() < 1e-13


def test_many_step_gauss_legendre_integrates_polynomials_exactly() -> None:
    alphas, weights = step_rule("gausslegendre", 3000)  # past numpy's eigenvalue method
    for degree in (0, 1, 7, 40):
        assert abs(np.dot(weights, alphas**degree) - 1.0 / (degree + 1)) < 1e-12


def test_bad_rules_are_user_errors() -> None:
    with pytest.raises(UserError, match="n_steps"):
        step_rule("riemann_left", 0)
    with pytest.raises(UserError, match="riemann_trapezoid needs n_steps >= 2"):
        step_rule("riemann_trapezoid", 1)
    with pytest.raises(UserError, match="unknown integration method"):
        step_rule("simpson", 10)


# --- completeness on models with a known integral --------------------------------------------------------------
class Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(6, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, context: dict) -> torch.Tensor:
        return self.proj(x).sum(1)  # [B, S, H] -> [B, 3]


def _linear_case() -> tuple[Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return Linear(), torch.randn(4, 5, 6, dtype=torch.float64), torch.randn(4, 5, 6, dtype=torch.float64)


@pytest.mark.parametrize("method", METHODS)
def test_linear_model_is_complete_for_every_rule(method: str) -> None:
    model, x, base = _linear_case()
    result = integrated_gradients(model, x, base, None, "predicted", IGOptions(n_steps=7, method=method))
    difference = result.scores - result.baseline_scores
    assert difference.abs().min() > 1e-2
    assert result.deltas.abs().max() < 1e-12 * difference.abs().max()


def test_captum_trapezoid_loses_one_nth_on_the_linear_model() -> None:
    """Captum's trapezoid weights sum to 1 - 1/n: its delta is -(F(x) - F(x'))/n where ours is 0."""
    model, x, base = _linear_case()
    n = 7
    ours = integrated_gradients(model, x, base, None, "predicted", IGOptions(n_steps=n, method="riemann_trapezoid"))
    ig = IntegratedGradients(lambda e: model(e, None, {}))
    _, captum_delta = ig.attribute(
        x, base, target=ours.target, n_steps=n, method="riemann_trapezoid", return_convergence_delta=True
    )
    expected = -(ours.scores - ours.baseline_scores) / n
    assert torch.allclose(captum_delta, expected, rtol=1e-6, atol=0)
    assert ours.deltas.abs().max() < 1e-12


class Quadratic(torch.nn.Module):
    """F(x) = 0.5 x^T A x per sample: along the path from 0 the IG integrand is c * alpha, c = x^T A x."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        torch.manual_seed(2)
        a = torch.randn(dim, dim, dtype=torch.float64)
        self.a = torch.nn.Parameter(a @ a.T)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, context: dict) -> torch.Tensor:
        flat = x.reshape(x.shape[0], -1)
        return 0.5 * torch.einsum("bi,ij,bj->b", flat, self.a, flat)


@pytest.mark.parametrize(
    ("method", "expected_delta"),
    [
        ("riemann_left", lambda c, n: -c / (2 * n)),
        ("riemann_right", lambda c, n: c / (2 * n)),
        ("riemann_middle", lambda c, n: 0 * c),
        ("riemann_trapezoid", lambda c, n: 0 * c),
        ("gausslegendre", lambda c, n: 0 * c),
    ],
)
def test_quadratic_model_deltas_follow_each_rule(method, expected_delta) -> None:
    x = torch.randn(3, 4, 2, dtype=torch.float64)
    model = Quadratic(8)
    n = 9
    result = integrated_gradients(model, x, torch.zeros_like(x), None, None, IGOptions(n_steps=n, method=method))
    c = 2 * result.scores  # x^T A x
    assert torch.allclose(result.deltas, expected_delta(c, n), rtol=0, atol=1e-10 * float(c.abs().max()))


# --- delta summary ---------------------------------------------------------------------------------------------
def test_delta_summary_warns_and_suggests_more_steps() -> None:
    scores, base = torch.tensor([2.0, 1.0, 4.0, 3.0]), torch.zeros(4)
    deltas = torch.tensor([0.2, -0.1, 0.4, 0.3])  # 10% of F(x) - F(baseline) each
    summary = delta_summary(deltas, scores, base, n_steps=50, method="riemann_right", threshold=0.05)
    assert summary["median_rel"] == pytest.approx(0.1)
    assert summary["warning"] and "n_steps = 100" in summary["warning"]
    assert summary["suggested_n_steps"] == 100  # first-order rule: halving the error doubles the steps
    quiet = delta_summary(deltas / 10, scores, base, n_steps=50, method="riemann_right", threshold=0.05)
    assert quiet["warning"] is None and quiet["suggested_n_steps"] is None


def test_delta_summary_warns_about_a_tail_of_unconverged_samples() -> None:
    scores, base = torch.ones(20), torch.zeros(20)
    deltas = torch.full((20,), 1e-4)
    deltas[:2] = torch.tensor([0.4, -0.2])  # 2 of 20 samples far off; the median is tiny
    summary = delta_summary(deltas, scores, base, n_steps=32, method="gausslegendre", threshold=0.05)
    assert summary["median_rel"] < 1e-3 and summary["p95_abs_vs_median_change"] > 0.05
    assert summary["warning"].startswith("2 of 20 samples have a convergence delta above 5.0% of the median")
    # second-order rule: p95 / threshold = 4.2 asks for sqrt(4.2) ~ 2x the steps
    assert summary["suggested_n_steps"] == 66
    one_off = deltas.clone()
    one_off[1] = 1e-4  # 1 of 20 (5%) is the 95th percentile's tolerance
    assert delta_summary(one_off, scores, base, n_steps=32, method="gausslegendre", threshold=0.05)["warning"] is None


def test_delta_summary_ignores_relative_deltas_of_samples_whose_output_hardly_moves() -> None:
    # rounding-sized deltas (1e-4) are large against a tiny F(x) - F(baseline) but not against the typical one
    change = torch.full((20,), 0.5)
    change[:4] = 1e-3
    deltas = torch.full((20,), 1e-4)
    summary = delta_summary(deltas, change, torch.zeros(20), n_steps=50, method="gausslegendre", threshold=0.05)
    assert summary["p95_rel"] > 0.05  # 10% for the four samples that hardly move
    assert summary["warning"] is None


# --- chunk planning --------------------------------------------------------------------------------------------
def test_planner_fixed_balanced_and_all_steps() -> None:
    assert ChunkPlanner(10).next_steps(50, rows=8, tokens=128, device=CPU) == 10
    assert ChunkPlanner(20).next_steps(50, rows=8, tokens=128, device=CPU) == 17  # 3 chunks of 17/17/16
    assert ChunkPlanner(None).next_steps(50, rows=8, tokens=128, device=CPU) == 50
    assert ChunkPlanner(100).next_steps(7, rows=8, tokens=128, device=CPU) == 7


def test_planner_cpu_auto_uses_a_fixed_row_token_budget() -> None:
    planner = ChunkPlanner("auto")
    assert planner.next_steps(2000, rows=8, tokens=128, device=CPU) == 8
    assert planner.next_steps(2000, rows=64, tokens=512, device=CPU) == 1


def test_planner_halves_after_out_of_memory_and_keeps_the_ceiling() -> None:
    events = []
    planner = ChunkPlanner(40, on_event=lambda type, **f: events.append((type, f)))
    assert planner.shrink(40, rows=4, tokens=10) is True
    assert events == [("oom_retry", {"steps": 40, "retry_steps": 20, "rows": 4, "tokens": 10})]
    assert planner.next_steps(100, rows=4, tokens=10, device=CPU) == 20
    assert planner.next_steps(80, rows=2, tokens=10, device=CPU) == 40  # half the rows: twice the steps
    assert planner.shrink(1, rows=4, tokens=10) is False


def test_planner_rejects_bad_settings() -> None:
    with pytest.raises(UserError, match="alpha_batch_size"):
        ChunkPlanner(0)
    with pytest.raises(UserError, match="memory_fraction"):
        ChunkPlanner("auto", memory_fraction=1.5)


@pytest.mark.parametrize("n", [2, 3, 9, 16, 2049])
def test_clenshaw_curtis_integrates_polynomials_up_to_its_degree(n: int) -> None:
    alphas, weights = step_rule("clenshaw_curtis", n)
    assert alphas[0] == 0.0 and alphas[-1] == 1.0
    for degree in range(min(n, 40)):  # n points: exact up to degree n - 1
        assert abs((weights * alphas**degree).sum() - 1 / (degree + 1)) < 1e-13, degree
