"""Work split between ranks, and the run outcome the supervisor derives from its ranks' reports."""

from __future__ import annotations

import random

from gpuopt_tui.jobs.runner import outcome_of_ranks
from gpuopt_tui.jobs.sharding import balanced_owners, mine
from gpuopt_tui.jobs.tracin.shards import split_blocks


def test_every_item_goes_to_exactly_one_rank_and_loads_stay_balanced() -> None:
    rng = random.Random(0)
    costs = [rng.randint(1, 100) for _ in range(200)]
    owners = balanced_owners(costs, 3)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(3)]
    assert set(owners) == {0, 1, 2}
    assert max(loads) - min(loads) <= max(costs)
    parts = [mine(list(range(200)), costs, r, 3) for r in range(3)]
    assert sorted(i for p in parts for i in p) == list(range(200))


def test_one_rank_does_everything() -> None:
    assert balanced_owners([5, 1, 3], 1) == [0, 0, 0]


def test_tracin_blocks_interleave_rows_over_ranks() -> None:
    blocks, owners = split_blocks(list(range(10)), shard_size=3, world_size=2)
    assert blocks == [[0, 2, 4], [6, 8], [1, 3, 5], [7, 9]] and owners == [0, 0, 1, 1]
    assert split_blocks(list(range(5)), 2, 1) == ([[0, 1], [2, 3], [4]], [0, 0, 0])


def event(type: str, rank: int, t: float, **fields: object) -> dict:
    return {"type": type, "rank": rank, "t": t, "host": "h", **fields}


def test_the_first_failing_rank_names_the_failure() -> None:
    events = [event("rank_cancelled", 0, 3.0), event("rank_failed", 1, 2.0, message="disk full")]
    kind, fields = outcome_of_ranks(events, 1, cancel_requested=False)
    assert kind == "failed" and fields["message"].startswith("rank 1 on h: disk full")


def test_finished_needs_rank_0_and_a_clean_exit() -> None:
    done = [event("rank_finished", 1, 1.0), event("rank_finished", 0, 2.0, summary={"n": 3})]
    assert outcome_of_ranks(done, 0, False) == ("finished", {"summary": {"n": 3}})
    assert outcome_of_ranks(done[:1], 0, False)[0] == "failed"
    assert outcome_of_ranks([], 1, True)[0] == "cancelled"
    kind, fields = outcome_of_ranks([], -9, False)
    assert kind == "failed" and "code -9" in fields["message"]
