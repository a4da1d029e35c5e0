"""Selecting a training subset from a TracIn run's dataset-level ranking (dataset_ranking.jsonl): the top k, or the
top p%, of the training examples by their mean or max influence over the run's test examples."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.results.tracin import DatasetRanked

RANK_BY = ("mean", "max")


def selection_size(n: int, top: int | None, percent: float | None) -> int:
    """How many of `n` ranked examples the top `top`, or the top `percent`% (rounded up), are."""
    if top is not None and percent is not None:
        raise UserError("give --top or --percent, not both")
    if percent is not None:
        if not 0 < percent <= 100:
            raise UserError(f"--percent {percent}: expected a number above 0 and at most 100")
        return math.ceil(n * percent / 100)
    if top is None or top < 1:
        raise UserError(f"--top {top}: expected a whole number of at least 1")
    return min(top, n)


def select_top(rows: Sequence[DatasetRanked], by: str, size: int) -> list[DatasetRanked]:
    """The `size` highest rows by mean or max influence (ties: the other score, then the lower index); rows that no
    test example was scored against come last."""
    if by not in RANK_BY:
        raise UserError(f"--by {by}: expected one of {', '.join(RANK_BY)}")

    def key(row: DatasetRanked) -> tuple[bool, float, float, int]:
        first, second = (row.mean, row.max) if by == "mean" else (row.max, row.mean)
        if first is None or second is None:
            return (True, 0.0, 0.0, row.index)
        return (False, -first, -second, row.index)

    return sorted(rows, key=key)[:size]


def selection_records(rows: Sequence[DatasetRanked], by: str) -> list[dict[str, Any]]:
    """The selected rows as records to export, ranked anew in the selection's order (`rank`), with their rank in
    the run's ranking by mean influence (`mean_rank`)."""
    return [
        {
            "rank": rank,
            "index": row.index,
            "mean_influence": row.mean,
            "max_influence": row.max,
            "n_queries": row.n_queries,
            "mean_rank": row.rank,
            "ranked_by": by,
            "text": row.text,
            **({"completion": row.completion} if row.completion is not None else {"label": row.label}),
        }
        for rank, row in enumerate(rows, 1)
    ]
