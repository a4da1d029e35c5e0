"""The dataset-level ranking: each training example's mean and max influence over the query (test) set, on a small
matrix whose answer is worked out by hand, and from the engine in several shards with a pair filter, against the
engine's own score matrix reduced here with plain Python."""

from __future__ import annotations

import math

import pytest
import torch
from test_tracin_support import bert_adapter, save_checkpoints, text_dataset

from gpuopt_tui.jobs.tracin import TracInOptions, select_parameters, tracin_scores
from gpuopt_tui.jobs.tracin.dataset_ranking import query_mean_max, ranking_records
from gpuopt_tui.jobs.tracin.filters import get_filter

NAN = float("nan")


def test_mean_and_max_over_the_queries_of_a_small_matrix() -> None:
    scores = torch.tensor(
        [
            [1.0, -2.0, NAN, 4.0, NAN],
            [3.0, -6.0, 5.0, -4.0, NAN],
            [2.0, 2.0, NAN, 0.5, NAN],
        ],
        dtype=torch.float64,
    )
    mean, best, count = query_mean_max(scores)
    assert count.tolist() == [3, 3, 1, 3, 0]
    assert mean[:4].tolist() == [2.0, -2.0, 5.0, 0.5 / 3] and math.isnan(mean[4])
    assert best[:4].tolist() == [3.0, 2.0, 5.0, 4.0] and math.isnan(best[4])
    records = ranking_records(torch.tensor([10, 11, 12, 13, 14]), mean, best, count, lambda i: {"text": f"t{i}"})
    assert [r["index"] for r in records] == [12, 10, 13, 11, 14]  # mean 5, 2, 1/6, -2, then the unscored one
    assert [r["rank"] for r in records] == [1, 2, 3, 4, 5]
    assert records[-1] == {
        "rank": 5,
        "index": 14,
        "mean_influence": None,
        "max_influence": None,
        "n_queries": 0,
        "text": "t14",
    }
    assert records[0]["text"] == "t12" and records[0]["max_influence"] == 5.0


def test_equal_means_rank_by_max_then_index() -> None:
    mean = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)
    best = torch.tensor([2.0, 3.0, 2.0], dtype=torch.float64)
    records = ranking_records(torch.tensor([5, 6, 4]), mean, best, torch.tensor([2, 2, 2]), lambda i: {})
    assert [r["index"] for r in records] == [6, 4, 5]


@pytest.mark.parametrize("pair_filter", ["none", "same_label"])
def test_the_engine_reduces_every_shard_like_its_matrix(tmp_path, pair_filter: str) -> None:
    adapter = bert_adapter(torch.float64)
    checkpoints = save_checkpoints(adapter, tmp_path)
    train, test = text_dataset(adapter, 11, seed=3), text_dataset(adapter, 4, seed=4)
    names = select_parameters(adapter, test.batch([0]), "last", 2)
    options = TracInOptions(shard_size=4, batch_size=3)  # three blocks of training examples
    result = tracin_scores(adapter, checkpoints, train, test, names, options, pair_filter=get_filter(pair_filter))
    assert result.matrix is not None and result.query_mean is not None and result.query_max is not None
    columns = [[v for v in column if not math.isnan(v)] for column in result.matrix.T.tolist()]
    if pair_filter != "none":
        assert any(len(c) < len(test) for c in columns)  # the filter left pairs out
    for j, column in enumerate(columns):
        assert int(result.query_count[j]) == len(column)
        if column:
            assert float(result.query_mean[j]) == pytest.approx(sum(column) / len(column), rel=1e-12)
            assert float(result.query_max[j]) == max(column)
        else:
            assert math.isnan(float(result.query_mean[j])) and math.isnan(float(result.query_max[j]))
