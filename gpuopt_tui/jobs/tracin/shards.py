"""The running sums of TracIn scores kept per (checkpoint, block of training examples), so a run resumes where it
stopped: where the shards are kept (`ShardStore`), how training rows are cut into blocks, and how the blocks'
final shards are merged into self-influence, top-k per test example and the score matrix."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from gpuopt_tui.jobs.tracin.dataset_ranking import query_mean_max
from gpuopt_tui.jobs.tracin.filters import PairFilter
from gpuopt_tui.jobs.tracin.interface import InfluenceResult, TopK, TracInOptions


class ShardStore(Protocol):
    def has(self, name: str) -> bool: ...
    def load(self, name: str) -> dict[str, Tensor] | None: ...
    def save(self, name: str, tensors: dict[str, Tensor]) -> None: ...
    def delete(self, name: str) -> None: ...


class MemoryStore:
    """Shards kept in a dict (library use without resume)."""

    def __init__(self) -> None:
        self.shards: dict[str, dict[str, Tensor]] = {}

    def has(self, name: str) -> bool:
        return name in self.shards

    def load(self, name: str) -> dict[str, Tensor] | None:
        return self.shards.get(name)

    def save(self, name: str, tensors: dict[str, Tensor]) -> None:
        self.shards[name] = tensors

    def delete(self, name: str) -> None:
        self.shards.pop(name, None)


def shard_name(checkpoint: int, block: int) -> str:
    return f"tracin_c{checkpoint:03d}_b{block:05d}.safetensors"


def split_blocks(rows: list[int], shard_size: int, world_size: int) -> tuple[list[list[int]], list[int]]:
    """Blocks of at most `shard_size` rows and the rank that scores each. `rows` come longest first; with
    several ranks each takes every world_size-th row, so all get a similar mix of lengths."""
    blocks: list[list[int]] = []
    owners: list[int] = []
    for rank in range(world_size):
        part = rows[rank::world_size]
        for i in range(0, len(part), shard_size):
            blocks.append(part[i : i + shard_size])
            owners.append(rank)
    return blocks, owners


def latest_shard(store: ShardStore, block: int, n_ckpt: int) -> int:
    """The last checkpoint whose running sums for `block` are saved (-1: none)."""
    return next((c for c in reversed(range(n_ckpt)) if store.has(shard_name(c, block))), -1)


class TopKMerger:
    """The k largest (or smallest) scores per row over column blocks seen one at a time; NaN = not scored."""

    def __init__(self, n_rows: int, k: int, largest: bool) -> None:
        self.k = k
        self.largest = largest
        self.fill = float("-inf") if largest else float("inf")
        self.scores = torch.empty(n_rows, 0)
        self.rows = torch.empty(n_rows, 0, dtype=torch.long)

    def update(self, scores: Tensor, rows: Tensor) -> None:
        scores = torch.where(scores.isnan(), self.fill, scores)
        cand = torch.cat([self.scores.to(scores.dtype), scores], 1)
        cand_rows = torch.cat([self.rows, rows.expand(scores.shape[0], -1)], 1)
        top = cand.topk(min(self.k, cand.shape[1]), dim=1, largest=self.largest)
        self.scores, self.rows = top.values, cand_rows.gather(1, top.indices)

    def result(self) -> TopK:
        missing = self.scores == self.fill
        return TopK(self.rows.masked_fill(missing, -1), self.scores.masked_fill(missing, float("nan")))


def gather_shards(
    store: ShardStore,
    blocks: list[list[int]],
    n_test: int,
    n_ckpt: int,
    pair_filter: PairFilter | None,
    keys: tuple[Tensor, Tensor] | None,
    opts: TracInOptions,
) -> InfluenceResult:
    """Final shards -> self-influence, top-k per test example, each training example's mean and max over the test
    examples (dataset_ranking.py) and (optionally) the matrix, in row order."""
    train_rows = torch.tensor(sorted(r for rows in blocks for r in rows), dtype=torch.long)
    position = torch.zeros(int(train_rows.max()) + 1 if len(train_rows) else 0, dtype=torch.long)
    position[train_rows] = torch.arange(len(train_rows))
    proponents = TopKMerger(n_test, opts.top_k, largest=True)
    opponents = TopKMerger(n_test, opts.top_k, largest=False)
    selfinf: Tensor | None = None
    matrix: Tensor | None = None
    over_queries = [torch.zeros(len(train_rows), dtype=torch.float64) for _ in range(3)]  # mean, max, count
    for j, rows in enumerate(blocks):
        shard = store.load(shard_name(n_ckpt - 1, j))
        if shard is None:
            raise RuntimeError(f"shard {shard_name(n_ckpt - 1, j)} is missing")
        rows_t = torch.tensor(rows, dtype=torch.long)
        scores = shard["scores"]
        if pair_filter is not None and keys is not None:
            scores = scores.masked_fill(~pair_filter.mask(keys[0], keys[1][rows_t]), float("nan"))
        proponents.update(scores, rows_t)
        opponents.update(scores, rows_t)
        cols = position[rows_t]
        if selfinf is None:
            selfinf = torch.zeros(len(train_rows), dtype=scores.dtype)
            if opts.keep_matrix:
                matrix = torch.full((n_test, len(train_rows)), float("nan"), dtype=scores.dtype)
        selfinf[cols] = shard["self_influence"]
        for whole, part in zip(over_queries, query_mean_max(scores)):
            whole[cols] = part.double()
        if matrix is not None:
            matrix[:, cols] = scores
    if selfinf is None:
        selfinf = torch.zeros(0)
        matrix = torch.zeros(n_test, 0) if opts.keep_matrix else None
    mean, best, count = over_queries
    return InfluenceResult(
        train_rows,
        selfinf,
        proponents.result(),
        opponents.result(),
        matrix,
        query_mean=mean,
        query_max=best,
        query_count=count.long(),
    )
