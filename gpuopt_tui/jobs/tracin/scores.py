"""TracInCP: influence(train z, test z') = sum over checkpoints c of lr_c * <grad L(z; w_c), grad L(z'; w_c)>.

Checkpoints are the outer loop: each is loaded once (its file read in a background thread while the checkpoint
before it is scored), the test gradients are computed once per checkpoint, and the training examples stream past
them in micro-batches (by default as large as the GPU memory allows, so a block of a few thousand examples of a
small model is one forward pass per checkpoint; the engine waits for the GPU once per block, when it saves the
block's sums). Training examples are cut into blocks; after each (checkpoint, block) the block's running sums
(scores against every test example, and self-influence sum_c lr_c * ||g_c||^2) are saved as a shard, so a resumed
run redoes at most one block. Top-k proponents and opponents are merged block by block at the end. Scores
accumulate in fp32 (float64 for float64 models).
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import Tensor
from torch.profiler import record_function

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.feature_cache import file_sha256
from gpuopt_tui.jobs.attribution.chunking import ChunkPlanner
from gpuopt_tui.jobs.data import TextDataset, trim_batch
from gpuopt_tui.jobs.device import free_memory, is_oom
from gpuopt_tui.jobs.models.base import Adapter, Checkpoint, to_device
from gpuopt_tui.jobs.tracin.filters import PairFilter
from gpuopt_tui.jobs.tracin.grad_cache import CheckpointGradients, rounded
from gpuopt_tui.jobs.tracin.grads import GradFeatures, GradientComputer
from gpuopt_tui.jobs.tracin.params import count_parameters
from gpuopt_tui.jobs.tracin.prefetch import CheckpointLoader
from gpuopt_tui.jobs.tracin.project import Projector


@dataclass
class TracInOptions:
    method: str = "auto"  # auto | closed_form | vmap | factored (see grads.py)
    precision: str = "fp32"  # forward precision: fp32, bf16 or fp16 (jobs.device.autocast)
    projection_dim: int = 0  # closed_form, vmap: 0 = exact gradients
    projection_in: int = 0  # factored: projected size of each layer's input side (0 = exact)
    projection_out: int = 0  # factored: projected size of each layer's output side (0 = exact)
    seed: int = 0  # projection seed
    batch_size: int | Literal["auto"] = "auto"  # micro-batch (examples), halved on out-of-memory
    gradient_checkpointing: bool = False
    cleanup_every: int = 0  # examples between memory clean-ups (0 = never)
    prefetch: bool = True  # read the next checkpoint's file while the current checkpoint is scored
    shard_size: int = 4096  # training examples per saved block
    top_k: int = 10
    keep_matrix: bool = True  # return the full [n_test, n_scored] score matrix
    train_cache: Path | None = None  # keep the training gradients there (core/gradient_cache.py) and reuse them


@dataclass
class TopK:
    """Per test example: `rows` [n_test, k] (training rows, -1 where fewer than k were scored), `scores`."""

    rows: Tensor
    scores: Tensor


@dataclass
class InfluenceResult:
    train_rows: Tensor  # [M] training rows that were scored, ascending (all of them without a filter)
    self_influence: Tensor  # [M]
    proponents: TopK  # the k highest scores per test example
    opponents: TopK  # the k lowest
    matrix: Tensor | None  # [n_test, M]; NaN where the filter left the pair out
    stats: dict[str, Any] = field(default_factory=dict)


class Reporter:
    """Where the engine reports progress and events and asks whether to stop; this one ignores it all."""

    def progress(self, done: int, total: int, stage: str) -> None:
        pass

    def event(self, type: str, **fields: Any) -> None:
        pass

    def check_cancelled(self) -> None:
        pass


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


# --- micro-batches -------------------------------------------------------------------------------------------
class MicroBatcher:
    """Feeds rows of a dataset to a `GradientComputer` in micro-batches sized by a `ChunkPlanner` (one
    "step" = one example): a fixed size, or "auto", where on a GPU the first micro-batch is a memory probe
    and later ones fill a share of the free memory. On out-of-memory the size is halved for the rest of the
    run and the micro-batch retried."""

    def __init__(self, size: int | Literal["auto"], reporter: Reporter) -> None:
        self.planner = ChunkPlanner(size, on_event=self._planner_event)
        self.reporter = reporter
        self.ooms = 0
        self._lengths: dict[int, Tensor] = {}  # id(dataset) -> real tokens per example, computed once

    def run(
        self, computer: GradientComputer, ds: TextDataset, rows: Sequence[int], what: str
    ) -> Iterator[tuple[int, GradFeatures]]:
        """(offset into `rows`, features of the micro-batch starting there); `what` names the examples
        ("train", "test") in profiler traces."""
        device = computer.adapter.device
        lengths = self._lengths.setdefault(id(ds), ds.lengths())
        # tokens of the longest row from each offset on: a bound on every later micro-batch's padded length
        longest = lengths[list(rows)].flip(0).cummax(0).values.flip(0).tolist() if len(rows) else []
        start = 0
        while start < len(rows):
            tokens = max(1, longest[start])
            size = self.planner.next_steps(len(rows) - start, 1, tokens, device)
            with record_function(f"tracin.{what}_gradients"):
                feats = self._attempt(computer, ds, rows[start : start + size])
            if feats is None:
                gc.collect()  # the failed attempt's tensors
                free_memory(device)
                if not self.planner.shrink(size, 1, tokens):
                    raise UserError(
                        "out of memory with one example per micro-batch: use a projection (projection_dim), "
                        "fewer layers, mixed precision, or a larger GPU"
                    )
                self.ooms += 1
                continue
            self.planner.chunk_done(size, 1, tokens, device)
            yield start, feats
            del feats  # not held while the next micro-batch is computed
            start += size

    def _planner_event(self, type: str, **fields: Any) -> None:
        if type == "oom_retry":
            self.reporter.event("oom_retry", batch_size=fields["steps"], retry_batch_size=fields["retry_steps"])
        elif type == "chunk_probe":
            self.reporter.event(
                "batch_probe",
                examples=fields["steps"],
                tokens=fields["tokens"],
                peak_bytes=fields["peak_bytes"],
                budget_bytes=fields["budget_bytes"],
            )

    def probes_next(self, device: torch.device) -> bool:
        """Whether the next micro-batch will be the memory probe of an "auto" size on a GPU."""
        planner = self.planner
        return planner.setting == "auto" and device.type == "cuda" and planner.bytes_per_row_token is None

    @staticmethod
    def _attempt(computer: GradientComputer, ds: TextDataset, rows: Sequence[int]) -> GradFeatures | None:
        """The features of `rows`, or None when memory ran out."""
        device = computer.adapter.device
        batch = trim_batch(ds.batch(rows), ds.token_fields)
        if device.type == "cuda":  # from page-locked memory the copy is queued without waiting for the GPU
            batch = {k: v.pin_memory() for k, v in batch.items()}
        batch = to_device(batch, device)
        try:
            return computer.features(batch)
        except Exception as exc:
            if not is_oom(exc):
                raise
            return None

    def features(self, computer: GradientComputer, ds: TextDataset, rows: Sequence[int], what: str) -> GradFeatures:
        """The features of every row, gathered in one preallocated block (no second copy)."""
        out: GradFeatures | None = None
        for offset, part in self.run(computer, ds, rows, what):
            out = out if out is not None else GradFeatures.empty(part, len(rows))
            out.put(offset, part)
        if out is None:
            raise ValueError("no rows")
        return out


class Cleanup:
    """Frees cached GPU memory every `every` examples (0 = never), for other processes on a shared GPU.
    Tensors are freed by reference counting as soon as the engine drops them, so no garbage collection pass
    runs here: a full pass takes a tenth of a second or more in a process holding transformers."""

    def __init__(self, every: int, device: torch.device) -> None:
        self.every = every
        self.device = device
        self.count = 0
        self.runs = 0

    def step(self, examples: int) -> None:
        self.count += examples
        if self.every and self.count >= self.every:
            self.count = 0
            self.runs += 1
            free_memory(self.device)


# --- top-k ------------------------------------------------------------------------------------------------------
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


# --- the computation -----------------------------------------------------------------------------------------------
def tracin_scores(
    adapter: Adapter,
    checkpoints: Sequence[Checkpoint],
    train: TextDataset,
    test: TextDataset,
    params: Sequence[str],
    options: TracInOptions | None = None,
    *,
    pair_filter: PairFilter | None = None,
    store: ShardStore | None = None,
    reporter: Reporter | None = None,
) -> InfluenceResult:
    """TracInCP scores of `train` examples on `test` examples over `checkpoints`, for the parameters `params`
    (names from `select_parameters`). Loads each checkpoint into `adapter.model` in turn."""
    run = TracInRun(adapter, checkpoints, train, test, params, options, pair_filter, store, reporter)
    stats = run.compute()
    return run.gather([stats])


class TracInRun:
    """TracInCP in two steps, so that several processes can share it: `compute(rank, world_size)` scores the
    blocks of training examples that fall to `rank` and saves their shards; `gather` (on one process, once
    every rank has computed) merges all the blocks' shards."""

    def __init__(
        self,
        adapter: Adapter,
        checkpoints: Sequence[Checkpoint],
        train: TextDataset,
        test: TextDataset,
        params: Sequence[str],
        options: TracInOptions | None = None,
        pair_filter: PairFilter | None = None,
        store: ShardStore | None = None,
        reporter: Reporter | None = None,
    ) -> None:
        if not checkpoints:
            raise UserError("TracIn needs at least one checkpoint")
        self.adapter, self.checkpoints, self.train, self.test = adapter, checkpoints, train, test
        self.params = params
        self.opts = options or TracInOptions()
        self.pair_filter = pair_filter
        self.store = store if store is not None else MemoryStore()
        self.reporter = reporter or Reporter()
        self.keys = _filter_keys(pair_filter, test, train)
        self.scored = _scored_rows(train, pair_filter, self.keys)
        self.blocks: list[list[int]] = []
        self.owners: list[int] = []

    def compute(self, rank: int = 0, world_size: int = 1) -> dict[str, Any]:
        """Score this rank's blocks (those without a final shard); returns this rank's statistics."""
        opts, adapter, reporter, store = self.opts, self.adapter, self.reporter, self.store
        device = adapter.device
        dtype = torch.promote_types(next(adapter.model.parameters()).dtype, torch.float32)
        projector = Projector(opts.projection_dim, opts.seed, device, dtype) if opts.projection_dim else None
        computer = GradientComputer(
            adapter,
            self.params,
            method=opts.method,
            precision=opts.precision,
            projector=projector,
            gradient_checkpointing=opts.gradient_checkpointing,
            factored_sizes=(opts.projection_in, opts.projection_out),
            seed=opts.seed,
        )
        self.blocks, self.owners = split_blocks(self.scored, opts.shard_size, world_size)
        mine = [j for j, owner in enumerate(self.owners) if owner == rank]
        n_test, n_ckpt = len(self.test), len(self.checkpoints)
        done_through = {j: _latest_shard(store, j, n_ckpt) for j in mine}
        total = n_ckpt * sum(len(self.blocks[j]) for j in mine)
        done = sum((done_through[j] + 1) * len(self.blocks[j]) for j in mine)
        batcher = MicroBatcher(opts.batch_size, reporter)
        cleanup = Cleanup(opts.cleanup_every, device)
        loaded = final_batch = 0
        self.cache_hits = self.cache_misses = 0
        cache_parts = self._cache_parts(computer) if opts.train_cache else {}
        start = time.perf_counter()
        # the checkpoints with a block left to score, each read from disk while the one before is scored
        needed = [c for c in range(n_ckpt) if any(done_through[j] < c for j in mine)]
        with CheckpointLoader(adapter, [self.checkpoints[c].path for c in needed], prefetch=opts.prefetch) as loader:
            for c in needed:
                ckpt = self.checkpoints[c]
                pending = [j for j in mine if done_through[j] < c]
                test_feats = None  # the previous checkpoint's are freed before this one's are computed
                with record_function("tracin.load_checkpoint"):
                    loader.load_next()
                loaded += 1
                stage = f"checkpoint {c + 1}/{n_ckpt}"
                cached = (
                    CheckpointGradients(opts.train_cache, {**cache_parts, "checkpoint": file_sha256(ckpt.path)})
                    if opts.train_cache
                    else None
                )
                # The test gradients come first when the run's first micro-batch is to measure the memory an
                # example takes (they are needed anyway), and with vmap, whose per-example gradients are large.
                # Otherwise they come after the first training micro-batch is queued (below): their small forward,
                # bound by the host's kernel launches, then runs while the GPU is busy.
                if n_test and (batcher.probes_next(device) or computer.method != "closed_form"):
                    test_feats = batcher.features(computer, self.test, range(n_test), "test")
                for j in pending:
                    rows = self.blocks[j]
                    prev = store.load(shard_name(c - 1, j)) if c else None
                    scores = torch.zeros(n_test, len(rows), device=device, dtype=dtype)
                    selfinf = torch.zeros(len(rows), device=device, dtype=dtype)
                    if prev is not None:
                        scores += prev["scores"].to(device, dtype)
                        selfinf += prev["self_influence"].to(device, dtype)
                    for offset, feats in self._train_features(batcher, computer, cached, j, rows):
                        if test_feats is None and n_test:
                            test_feats = batcher.features(computer, self.test, range(n_test), "test")
                        part = slice(offset, offset + len(feats))
                        with record_function("tracin.products"):
                            if test_feats is not None:
                                scores[:, part] += ckpt.lr * test_feats.inner(feats)
                            selfinf[part] += ckpt.lr * feats.sqnorm()
                        done += len(feats)
                        final_batch = len(feats)
                        cleanup.step(len(feats))
                        del feats  # not held while the next micro-batch is computed
                        reporter.progress(done, total, stage)
                        reporter.check_cancelled()
                    with record_function("tracin.save_shard"):
                        store.save(shard_name(c, j), {"scores": scores.cpu(), "self_influence": selfinf.cpu()})
                        if c:
                            store.delete(shard_name(c - 1, j))
                    done_through[j] = c
        return {
            "method": computer.method,
            "gradient_size": _feature_size(computer, projector),
            "excluded_parameters": computer.factored.excluded if computer.factored else [],
            "checkpoints_loaded": loaded,
            "seconds": time.perf_counter() - start,
            "final_batch_size": final_batch,
            "oom_retries": batcher.ooms,
            "cleanups": cleanup.runs,
            "cache_blocks": {"read": self.cache_hits, "computed": self.cache_misses} if opts.train_cache else None,
        }

    def _train_features(
        self,
        batcher: MicroBatcher,
        computer: GradientComputer,
        cached: CheckpointGradients | None,
        block: int,
        rows: list[int],
    ) -> Iterator[tuple[int, GradFeatures]]:
        """(offset, features) of a block's training rows: streamed in micro-batches, or with the cache on the
        whole block at once, read from the cache or computed, rounded as stored and saved there."""
        if cached is None:
            yield from batcher.run(computer, self.train, rows, "train")
            return
        dtype = torch.promote_types(next(self.adapter.model.parameters()).dtype, torch.float32)
        feats = cached.load(block, rows, self.adapter.device, dtype)
        if feats is None:
            feats = rounded(batcher.features(computer, self.train, rows, "train"))
            cached.save(block, rows, feats)
            self.cache_misses += 1
        else:
            self.cache_hits += 1
        yield 0, feats

    def _cache_parts(self, computer: GradientComputer) -> dict[str, Any]:
        """What cached training gradients depend on besides the checkpoint."""
        digest = hashlib.sha256()
        for key in sorted(self.train.tensors):
            digest.update(key.encode())
            digest.update(self.train.tensors[key].contiguous().numpy().tobytes())
        opts = self.opts
        return {
            "model": self.adapter.name,
            "train": digest.hexdigest(),
            "n_train": len(self.train),
            "parameters": list(self.params),
            "method": computer.method,
            "precision": opts.precision,
            "projection": [opts.projection_dim, opts.projection_in, opts.projection_out, opts.seed],
        }

    def gather(self, rank_stats: Sequence[dict[str, Any]]) -> InfluenceResult:
        """Merge every block's final shard; `rank_stats`: what `compute` returned on each rank."""
        with record_function("tracin.gather"):
            result = _gather(
                self.store, self.blocks, len(self.test), len(self.checkpoints), self.pair_filter, self.keys, self.opts
            )
        lead = rank_stats[0]
        result.stats = {
            **lead,
            "parameters": list(self.params),
            "n_parameters": count_parameters(self.adapter.model, self.params),
            "precision": self.opts.precision,
            "projection_dim": self.opts.projection_dim,
            "checkpoints_loaded": max(s["checkpoints_loaded"] for s in rank_stats),
            "n_scored": len(self.scored),
            "seconds": max(s["seconds"] for s in rank_stats),  # the slowest rank's
            "oom_retries": sum(s["oom_retries"] for s in rank_stats),
            "cleanups": sum(s["cleanups"] for s in rank_stats),
            "processes": len(rank_stats),
        }
        return result


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


def self_influence(
    adapter: Adapter,
    checkpoints: Sequence[Checkpoint],
    train: TextDataset,
    params: Sequence[str],
    options: TracInOptions | None = None,
) -> Tensor:
    """sum_c lr_c * ||grad L(z; w_c)||^2 for every training example [N] (high = unusual or mislabeled)."""
    opts = dataclasses.replace(options or TracInOptions(), keep_matrix=False)
    return tracin_scores(adapter, checkpoints, train, train.subset([]), params, opts).self_influence


def _filter_keys(pair_filter: PairFilter | None, test: TextDataset, train: TextDataset) -> tuple[Tensor, Tensor] | None:
    if pair_filter is None:
        return None
    return pair_filter.example_keys(test.tensors, "test"), pair_filter.example_keys(train.tensors, "training")


def _scored_rows(
    train: TextDataset, pair_filter: PairFilter | None, keys: tuple[Tensor, Tensor] | None, chunk: int = 65536
) -> list[int]:
    """Training rows to score (those the filter pairs with some test example), longest first: batches then
    hold examples of similar length, and the first one shows whether memory suffices."""
    rows = torch.arange(len(train))
    if pair_filter is not None and keys is not None and len(train):
        test_keys, train_keys = keys
        wanted = [pair_filter.mask(test_keys, train_keys[i : i + chunk]).any(0) for i in range(0, len(train), chunk)]
        rows = rows[torch.cat(wanted)]
    lengths = train.lengths()[rows]
    return rows[torch.sort(-lengths, stable=True).indices].tolist()


def _latest_shard(store: ShardStore, block: int, n_ckpt: int) -> int:
    """The last checkpoint whose running sums for `block` are saved (-1: none)."""
    return next((c for c in reversed(range(n_ckpt)) if store.has(shard_name(c, block))), -1)


def _gather(
    store: ShardStore,
    blocks: list[list[int]],
    n_test: int,
    n_ckpt: int,
    pair_filter: PairFilter | None,
    keys: tuple[Tensor, Tensor] | None,
    opts: TracInOptions,
) -> InfluenceResult:
    """Final shards -> self-influence, top-k per test example and (optionally) the matrix, in row order."""
    train_rows = torch.tensor(sorted(r for rows in blocks for r in rows), dtype=torch.long)
    position = torch.zeros(int(train_rows.max()) + 1 if len(train_rows) else 0, dtype=torch.long)
    position[train_rows] = torch.arange(len(train_rows))
    proponents = TopKMerger(n_test, opts.top_k, largest=True)
    opponents = TopKMerger(n_test, opts.top_k, largest=False)
    selfinf: Tensor | None = None
    matrix: Tensor | None = None
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
        if matrix is not None:
            matrix[:, cols] = scores
    if selfinf is None:
        selfinf = torch.zeros(0)
        matrix = torch.zeros(n_test, 0) if opts.keep_matrix else None
    return InfluenceResult(train_rows, selfinf, proponents.result(), opponents.result(), matrix)


def _feature_size(computer: GradientComputer, projector: Projector | None) -> int:
    """Numbers per example gradient: the parameter count, or its projected size."""
    if computer.factored is not None:
        return computer.factored.size()
    shapes = dict(computer.model.named_parameters())
    if projector is None:
        return count_parameters(computer.model, computer.names)
    return sum(projector.size(tuple(shapes[n].shape)) for n in computer.names)
