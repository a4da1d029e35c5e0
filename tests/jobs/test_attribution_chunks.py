"""Chunks of Integrated Gradients steps are sized by the positions the forward runs per row: the attributed tokens,
and a causal LM's completion, which the context carries as embeddings and the forward runs beside them."""

from __future__ import annotations

import torch

from gpuopt_tui.jobs.attribution.chunking import ChunkPlanner
from gpuopt_tui.jobs.attribution.passes import Passes, Rows
from gpuopt_tui.jobs.attribution.precision import StepPrecision

B, P, T, H = 2, 7, 5, 16


def rows(context: dict[str, torch.Tensor]) -> Rows:
    baselines = torch.zeros(B, P, H, dtype=torch.float64)
    return Rows(baselines, torch.ones_like(baselines), torch.zeros(0), None, context, None)


def lm_context() -> dict[str, torch.Tensor]:
    """As CausalLMAdapter.encode_context gives it, and a two-tower model's user vector beside."""
    return {
        "completion_embeds": torch.zeros(B, T, H, dtype=torch.float64),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": torch.ones(B, T, dtype=torch.long),
        "weights": torch.ones(B, T, dtype=torch.long),
        "user": torch.zeros(B, H, dtype=torch.float64),
    }


def test_the_completion_counts_in_the_positions_a_row_runs() -> None:
    assert rows({}).run_tokens == rows({}).tokens == P
    assert rows(lm_context()).tokens == P and rows(lm_context()).run_tokens == P + T


def test_the_planner_sizes_chunks_by_them() -> None:
    seen: list[int] = []

    class Recording(ChunkPlanner):
        def next_steps(self, remaining: int, n_rows: int, tokens: int, device: torch.device) -> int:
            seen.append(tokens)
            return super().next_steps(remaining, n_rows, tokens, device)

    passes = Passes(
        forward=lambda points, mask, context: points.sum((1, 2)),
        step=StepPrecision.of("fp32"),
        planner=Recording(None),
        compiler=None,
        on_chunk=None,
    )
    alphas = torch.linspace(0, 1, 4, dtype=torch.float64)
    total = passes.integrate(rows(lm_context()), alphas, torch.full((4,), 0.25, dtype=torch.float64))
    assert seen == [P + T] and torch.allclose(total, torch.ones(B * P * H, dtype=torch.float64))
