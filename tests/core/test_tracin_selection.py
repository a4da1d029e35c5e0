"""Selecting the top k or top p% of a TracIn run's dataset-level ranking, by mean or max influence, from its JSONL
or CSV file (as `gpuopt-tui select` does)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuopt_tui.core.atomic import write_csv, write_jsonl
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.results.tracin import DATASET_CSV_NAME, DATASET_JSONL_NAME, load_results
from gpuopt_tui.core.results.tracin_selection import select_top, selection_records, selection_size

# as the job writes them: ranked by mean; index 4 was scored against no test example
ROWS = [
    {"rank": 1, "index": 2, "mean_influence": 5.0, "max_influence": 5.0, "n_queries": 1, "text": "c", "label": 1},
    {"rank": 2, "index": 0, "mean_influence": 2.0, "max_influence": 3.0, "n_queries": 3, "text": "a", "label": 0},
    {"rank": 3, "index": 3, "mean_influence": 0.5, "max_influence": 9.0, "n_queries": 3, "text": "d", "label": 1},
    {"rank": 4, "index": 1, "mean_influence": -2.0, "max_influence": 3.0, "n_queries": 3, "text": "b", "label": 0},
    {"rank": 5, "index": 4, "mean_influence": None, "max_influence": None, "n_queries": 0, "text": "e", "label": 0},
]


@pytest.fixture(params=["jsonl", "csv"])
def ranking(request: pytest.FixtureRequest, tmp_path: Path):
    if request.param == "jsonl":
        write_jsonl(tmp_path / DATASET_JSONL_NAME, ROWS)
    else:
        write_csv(tmp_path / DATASET_CSV_NAME, ROWS)
    found = load_results(tmp_path).dataset_ranking
    assert found is not None
    return found.page(0, len(found))


def test_rows_read_back_from_either_file(ranking) -> None:
    assert [(r.rank, r.index, r.mean, r.max, r.n_queries, r.label) for r in ranking] == [
        (row["rank"], row["index"], row["mean_influence"], row["max_influence"], row["n_queries"], row["label"])
        for row in ROWS
    ]
    assert all(r.completion is None for r in ranking)


def test_top_k_by_mean_and_by_max(ranking) -> None:
    assert [r.index for r in select_top(ranking, "mean", 3)] == [2, 0, 3]
    # max: 9, 5, then the tie at 3 goes to the higher mean (index 0 over index 1); unscored last
    assert [r.index for r in select_top(ranking, "max", 5)] == [3, 2, 0, 1, 4]


def test_top_percent_rounds_up() -> None:
    assert selection_size(5, None, 20) == 1
    assert selection_size(5, None, 21) == 2
    assert selection_size(200, None, 5) == 10
    assert selection_size(5, 3, None) == 3 and selection_size(5, 9, None) == 5
    for top, percent in ((None, 0), (None, 101), (0, None), (2, 5)):
        with pytest.raises(UserError):
            selection_size(5, top, percent)


def test_exported_records_are_ranked_anew(ranking) -> None:
    records = selection_records(select_top(ranking, "max", 2), "max")
    assert [(r["rank"], r["index"], r["mean_rank"], r["ranked_by"]) for r in records] == [
        (1, 3, 3, "max"),
        (2, 2, 1, "max"),
    ]
    assert json.loads(json.dumps(records))[0]["label"] == 1
