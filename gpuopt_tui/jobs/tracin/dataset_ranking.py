"""The dataset-level ranking: each training example's mean and max influence over the whole query (test) set, for
selecting a training subset (e.g. the top 5% for a target task).

The mean rewards an example that helps many queries a little; the max one that helps some query a lot. Both are
taken over the queries a pair filter let through (`n_queries`); an example no query was scored against has none
and ranks last.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def query_mean_max(scores: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per column of `scores` [n_queries, n_train] (NaN: a pair the filter skipped): the mean and the max over the
    scored queries (NaN where none was scored), and how many were scored."""
    scored = ~scores.isnan()
    count = scored.sum(0)
    total = torch.where(scored, scores, 0).sum(0)
    mean = torch.where(count > 0, total / count.clamp_min(1), float("nan"))
    best = torch.where(scored, scores, float("-inf")).amax(0) if len(scores) else torch.full_like(mean, float("-inf"))
    return mean, torch.where(count > 0, best, float("nan")), count


def ranking_records(
    train_rows: Tensor, mean: Tensor, best: Tensor, count: Tensor, example: Callable[[int], dict[str, Any]]
) -> list[dict[str, Any]]:
    """One record per scored training example, highest mean influence first (ties: higher max, then lower index;
    no scored query: last): rank, index, mean_influence, max_influence (None where no query was scored), n_queries,
    then `example(index)` (its text, completion or label)."""
    rows = train_rows.tolist()
    means, bests, counts = mean.tolist(), best.tolist(), count.tolist()

    def key(j: int) -> tuple[bool, float, float, int]:
        scored = counts[j] > 0
        return (not scored, -means[j] if scored else 0.0, -bests[j] if scored else 0.0, rows[j])

    order = sorted(range(len(rows)), key=key)
    return [
        {
            "rank": rank,
            "index": rows[j],
            "mean_influence": means[j] if counts[j] else None,
            "max_influence": bests[j] if counts[j] else None,
            "n_queries": int(counts[j]),
            **example(rows[j]),
        }
        for rank, j in enumerate(order, 1)
    ]
