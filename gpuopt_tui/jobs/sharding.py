"""Work split between the processes of a run: the same answer on every rank, without talking."""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def balanced_owners(costs: Sequence[float], world_size: int) -> list[int]:
    """The rank that does each item: the costliest items first, each to the rank with the least work so far
    (ties to the lower rank), which keeps the slowest rank within one item of the average."""
    owners = [0] * len(costs)
    if world_size <= 1:
        return owners
    loads = [(0.0, rank) for rank in range(world_size)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(loads)
        owners[i] = rank
        heapq.heappush(loads, (load + costs[i], rank))
    return owners


def mine(items: Sequence[int], costs: Sequence[float], rank: int, world_size: int) -> list[int]:
    """The items of `items` (with their `costs`) that `rank` does, in their order."""
    owners = balanced_owners(costs, world_size)
    return [item for item, owner in zip(items, owners) if owner == rank]
