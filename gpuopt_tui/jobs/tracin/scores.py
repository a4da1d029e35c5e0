"""TracInCP: influence(train z, test z') = sum over checkpoints c of lr_c * <grad L(z; w_c), grad L(z'; w_c)>.

Checkpoints are the outer loop: each is loaded once (its file read in a background thread while the checkpoint
before it is scored), the test gradients are computed once per checkpoint, and the training examples stream past
them in micro-batches (by default as large as the GPU memory allows, so a block of a few thousand examples of a
small model is one forward pass per checkpoint; the engine waits for the GPU once per block, when it saves the
block's sums). Training examples are cut into blocks; after each (checkpoint, block) the block's running sums
(scores against every test example, and self-influence sum_c lr_c * ||g_c||^2) are saved as a shard, so a resumed
run redoes at most one block. Top-k proponents and opponents are merged block by block at the end. Scores
accumulate in fp32 (float64 for float64 models).

With options.optimizer_state = "adam" the training gradients are Adam-preconditioned from each checkpoint's
optimizer.pt (adam_state.py): influence = sum_c lr_c * <Γ_c(grad L(z; w_c)), grad L(z'; w_c)>.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.profiler import record_function

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.tracin import OPTIMIZER_STATES, PROJECTION_BASES
from gpuopt_tui.jobs.data import TextDataset
from gpuopt_tui.jobs.models.base import Adapter, Checkpoint
from gpuopt_tui.jobs.tracin.adam_state import DESCRIPTION, FORMULA, load_adam_state, optimizer_files
from gpuopt_tui.jobs.tracin.filters import PairFilter
from gpuopt_tui.jobs.tracin.grad_cache import TrainGradientCache, cache_key
from gpuopt_tui.jobs.tracin.grads import GradFeatures, GradientComputer
from gpuopt_tui.jobs.tracin.interface import InfluenceResult, Reporter, TracInOptions
from gpuopt_tui.jobs.tracin.microbatch import Cleanup, MicroBatcher
from gpuopt_tui.jobs.tracin.params import count_parameters
from gpuopt_tui.jobs.tracin.pca_basis import fit_to_examples
from gpuopt_tui.jobs.tracin.prefetch import CheckpointLoader
from gpuopt_tui.jobs.tracin.project import Projector
from gpuopt_tui.jobs.tracin.shards import MemoryStore, ShardStore, gather_shards, latest_shard, shard_name, split_blocks


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
        for name, choices in (("optimizer_state", OPTIMIZER_STATES), ("projection_basis", PROJECTION_BASES)):
            if (value := getattr(self.opts, name)) not in choices:
                raise UserError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        self.adam = self.opts.optimizer_state == "adam"
        self.optimizer_files = optimizer_files(checkpoints) if self.adam else []
        self.adam_described: dict[int, dict[str, Any]] = {}  # checkpoint -> its Adam settings, once loaded
        self.keys = _filter_keys(pair_filter, test, train)
        self.scored = _scored_rows(train, pair_filter, self.keys)
        self.blocks: list[list[int]] = []
        self.owners: list[int] = []
        self.fitted_bases: dict[Path, dict[tuple[str, int], Tensor]] = {}  # projection_basis = pca, by checkpoint
        self.fit_seconds = 0.0  # spent fitting those (not in the scoring rate: a fixed cost, not one per example)

    def compute(self, rank: int = 0, world_size: int = 1) -> dict[str, Any]:
        """Score this rank's blocks (those without a final shard); returns this rank's statistics."""
        opts, adapter = self.opts, self.adapter
        dtype = torch.promote_types(next(adapter.model.parameters()).dtype, torch.float32)
        projector = Projector(opts.projection_dim, opts.seed, adapter.device, dtype) if opts.projection_dim else None
        computer = GradientComputer(
            adapter,
            self.params,
            method=opts.method,
            precision=opts.precision,
            projector=projector,
            gradient_checkpointing=opts.gradient_checkpointing,
            factored_sizes=(opts.projection_in, opts.projection_out),
            seed=opts.seed,
            dense=self.adam,
        )
        self.blocks, self.owners = split_blocks(self.scored, opts.shard_size, world_size)
        mine = [j for j, owner in enumerate(self.owners) if owner == rank]
        n_ckpt = len(self.checkpoints)
        done_through = {j: latest_shard(self.store, j, n_ckpt) for j in mine}
        # the blocks left to score at each checkpoint that has some
        pending = {c: [j for j in mine if done_through[j] < c] for c in range(n_ckpt)}
        pending = {c: blocks for c, blocks in pending.items() if blocks}
        progress = _Progress(
            done=sum((done_through[j] + 1) * len(self.blocks[j]) for j in mine),
            total=n_ckpt * sum(len(self.blocks[j]) for j in mine),
        )
        batcher = MicroBatcher(opts.batch_size, self.reporter)
        cleanup = Cleanup(opts.cleanup_every, adapter.device)
        start = time.perf_counter()
        cache = self._cache(computer, dtype, [(c, j) for c, blocks in pending.items() for j in blocks])
        scorer = _Scorer(computer, batcher, cleanup, cache, dtype, progress)
        # each checkpoint is read from disk while the one before is scored
        with (
            cache or contextlib.nullcontext(),
            CheckpointLoader(adapter, [self.checkpoints[c].path for c in pending], prefetch=opts.prefetch) as loader,
        ):
            for c, blocks in pending.items():
                self._score_checkpoint(scorer, c, blocks, loader)
        return {
            "method": computer.method,
            "gradient_size": _feature_size(computer, projector),
            "excluded_parameters": computer.factored.excluded if computer.factored else {},  # name -> why
            "checkpoints_loaded": progress.loaded,
            "seconds": time.perf_counter() - start,
            "fit_seconds": self.fit_seconds,
            "computed": progress.computed,  # gradients (examples x checkpoints) computed here, none for shards found
            "from_cache": progress.from_cache,  # and read from the training-gradient cache
            "final_batch_size": progress.final_batch or None,  # None: no micro-batch ran
            "oom_retries": batcher.ooms,
            "cleanups": cleanup.runs,
            "cache_blocks": {"read": cache.read, "computed": cache.computed} if cache else None,
        }

    def _score_checkpoint(self, scorer: _Scorer, c: int, blocks: list[int], loader: CheckpointLoader) -> None:
        """Load checkpoint `c` and add its terms to each of `blocks`."""
        stage = f"checkpoint {c + 1}/{len(self.checkpoints)}"
        self.reporter.stage(f"{stage}: loading it")
        with record_function("tracin.load_checkpoint"):
            loader.load_next()
        scorer.progress.loaded += 1
        if scorer.cache is not None:
            scorer.cache.checkpoint(self.checkpoints[c].path)
        train_computer = scorer.computer
        if self.adam:
            self.reporter.stage(f"{stage}: reading its optimizer state")
            file = self.optimizer_files[c]
            state = load_adam_state(file, self.adapter, self.params, self.adapter.device, scorer.dtype)
            self.adam_described[c] = state.describe()
            train_computer = scorer.computer.preconditioned(state)
        self._fit_projection(scorer, self.checkpoints[c].path, stage)
        test = _TestGradients(self, scorer, f"{stage}: gradients of {len(self.test)} test examples")
        # The test gradients come first when the run's first micro-batch is to measure the memory an example takes
        # (they are needed anyway), and with vmap, whose per-example gradients are large. Otherwise they come after
        # the first training micro-batch is queued (in `_score_block`): their small forward, bound by the host's
        # kernel launches, then runs while the GPU is busy.
        if scorer.batcher.probes_next(self.adapter.device) or scorer.computer.method != "closed_form":
            test.features()
        for j in blocks:
            self._score_block(scorer, train_computer, c, j, test, stage)

    def _fit_projection(self, scorer: _Scorer, checkpoint: Path, stage: str) -> None:
        """projection_basis = pca: the factored projection's directions for the loaded checkpoint, before any gradient
        of it is projected: given (`fitted_bases`), those the cache's blocks were computed with, or fitted to the
        first pca_examples training examples (pca_basis.py); kept in `fitted_bases`."""
        factored = scorer.computer.factored
        if self.opts.projection_basis != "pca" or factored is None:
            return
        given = (self.opts.fitted_bases or {}).get(checkpoint)
        if given is not None:
            factored.set_bases(given)
            return
        rows = list(range(min(self.opts.pca_examples, len(self.train))))

        def fit() -> dict[tuple[str, int], Tensor]:
            self.reporter.stage(f"{stage}: fitting the projection to {len(rows)} training examples")
            started = time.perf_counter()
            try:
                return fit_to_examples(factored, self.train, rows, self.opts.seed)
            finally:
                self.fit_seconds += time.perf_counter() - started

        with record_function("tracin.fit_projection"):
            self.fitted_bases[checkpoint] = scorer.cache.bases(fit) if scorer.cache is not None else fit()
        factored.set_bases(self.fitted_bases[checkpoint])

    def _score_block(
        self, scorer: _Scorer, computer: GradientComputer, c: int, j: int, test: _TestGradients, stage: str
    ) -> None:
        """Add checkpoint `c`'s terms for block `j`'s training rows to the block's sums so far (its shard of the
        checkpoint before) and save the sums as its shard of `c`; `computer` gives the training gradients."""
        rows, lr, reporter, progress = self.blocks[j], self.checkpoints[c].lr, self.reporter, scorer.progress
        scores, selfinf = self._block_sums(scorer, c, j)
        cache_stage = f"{stage}: train gradient cache"
        on_rows = lambda n, at=progress.done: reporter.progress(at + n, progress.total, cache_stage)  # noqa: E731
        if scorer.cache is None:  # (with the cache the block says its own stage)
            reporter.progress(progress.done, progress.total, stage)
        reads = scorer.cache.read if scorer.cache is not None else 0
        for offset, feats in self._train_features(scorer.batcher, computer, scorer.cache, j, rows, on_rows):
            test_feats = test.features()
            part = slice(offset, offset + len(feats))
            with record_function("tracin.products"):
                if test_feats is not None:
                    scores[:, part] += lr * test_feats.inner(feats)
                selfinf[part] += lr * feats.self_products()
            scorer.count(len(feats), from_cache=scorer.cache is not None and scorer.cache.read > reads)
            del feats  # not held while the next micro-batch is computed
            reporter.progress(progress.done, progress.total, stage)
            reporter.check_cancelled()
        with record_function("tracin.save_shard"):
            self.store.save(shard_name(c, j), {"scores": scores.cpu(), "self_influence": selfinf.cpu()})
            if c:
                self.store.delete(shard_name(c - 1, j))

    def _block_sums(self, scorer: _Scorer, c: int, j: int) -> tuple[Tensor, Tensor]:
        """Block `j`'s running sums (scores against every test example, self-influence) before checkpoint `c`."""
        device, dtype = self.adapter.device, scorer.dtype
        prev = self.store.load(shard_name(c - 1, j)) if c else None
        scores = torch.zeros(len(self.test), len(self.blocks[j]), device=device, dtype=dtype)
        selfinf = torch.zeros(len(self.blocks[j]), device=device, dtype=dtype)
        if prev is not None:
            scores += prev["scores"].to(device, dtype)
            selfinf += prev["self_influence"].to(device, dtype)
        return scores, selfinf

    def _train_features(
        self,
        batcher: MicroBatcher,
        computer: GradientComputer,
        cache: TrainGradientCache | None,
        block: int,
        rows: list[int],
        on_rows: Callable[[int], None],
    ) -> Iterator[tuple[int, GradFeatures]]:
        """(offset, features) of a block's training rows: streamed in micro-batches, or with the cache on the
        whole block at once, read from the cache or computed and stored there (`on_rows(rows done)` after
        each micro-batch)."""
        if cache is None:
            yield from batcher.run(computer, self.train, rows, "train")
            return
        on_rows(0)
        compute = lambda: batcher.features(computer, self.train, rows, "train", on_rows)  # noqa: E731
        with record_function("tracin.cache_blocks"):
            feats = cache.block(block, rows, compute)
        yield 0, feats

    def _cache(
        self, computer: GradientComputer, dtype: torch.dtype, pending: list[tuple[int, int]]
    ) -> TrainGradientCache | None:
        """The training-gradient cache when the options name one, told which (checkpoint, block) pairs come."""
        opts = self.opts
        if not opts.train_cache:
            return None
        with record_function("tracin.cache_key"):
            parts = cache_key(self.adapter, self.train, self.params, computer.method, opts)
            companions = dict(zip((c.path for c in self.checkpoints), self.optimizer_files))
            cache = TrainGradientCache(
                opts.train_cache, parts, self.adapter.device, dtype, self.reporter.warn, companions=companions
            )
            cache.expect((self.checkpoints[c].path, j, self.blocks[j]) for c, j in pending)
        return cache

    def gather(self, rank_stats: Sequence[dict[str, Any]]) -> InfluenceResult:
        """Merge every block's final shard; `rank_stats`: what `compute` returned on each rank."""
        with record_function("tracin.gather"):
            result = gather_shards(
                self.store, self.blocks, len(self.test), len(self.checkpoints), self.pair_filter, self.keys, self.opts
            )
        lead = rank_stats[0]
        result.stats = {
            **lead,
            "parameters": list(self.params),
            "n_parameters": count_parameters(self.adapter.model, self.params),
            "precision": self.opts.precision,
            "projection_dim": self.opts.projection_dim,
            "optimizer_state": self._optimizer_state(),
            "checkpoints_loaded": max(s["checkpoints_loaded"] for s in rank_stats),
            "n_scored": len(self.scored),
            **attempt_figures(rank_stats),
            "oom_retries": sum(s["oom_retries"] for s in rank_stats),
            "cleanups": sum(s["cleanups"] for s in rank_stats),
            "processes": len(rank_stats),
        }
        return result

    def _optimizer_state(self) -> dict[str, Any] | None:
        """What preconditioned the training gradients (None: plain gradients), with each checkpoint's Adam
        settings (read again for a checkpoint whose shards an earlier attempt left)."""
        if not self.adam:
            return None
        described = [
            self.adam_described.get(c)
            or load_adam_state(file, self.adapter, self.params, torch.device("cpu"), torch.float32).describe()
            for c, file in enumerate(self.optimizer_files)
        ]
        return {"kind": "adam", "description": DESCRIPTION, "formula": FORMULA, "checkpoints": described}


@dataclasses.dataclass
class _Progress:
    """Where a rank's scoring stands: training examples x checkpoints `done` of `total`, and what ran here."""

    done: int
    total: int
    loaded: int = 0  # checkpoints
    computed: int = 0  # training gradients
    from_cache: int = 0  # training gradients read from the cache instead
    final_batch: int = 0  # the last micro-batch's size


@dataclasses.dataclass
class _Scorer:
    """What scores a rank's blocks, one checkpoint after the other."""

    computer: GradientComputer
    batcher: MicroBatcher
    cleanup: Cleanup
    cache: TrainGradientCache | None
    dtype: torch.dtype  # of the running sums
    progress: _Progress

    def count(self, examples: int, *, from_cache: bool) -> None:
        """Count a micro-batch of training gradients (or a block read from the cache) as scored."""
        self.progress.done += examples
        if from_cache:
            self.progress.from_cache += examples
        else:
            self.progress.computed += examples
        # a block read from the cache counts at once: the size is the last micro-batch of training rows computed
        self.progress.final_batch = self.batcher.last_size.get("train", 0)
        self.cleanup.step(examples)


class _TestGradients:
    """The test examples' gradients at the loaded checkpoint, computed once, when first asked for (None without
    test examples)."""

    def __init__(self, run: TracInRun, scorer: _Scorer, stage: str) -> None:
        self.run, self.scorer, self.stage = run, scorer, stage
        self.feats: GradFeatures | None = None

    def features(self) -> GradFeatures | None:
        test = self.run.test
        if self.feats is None and len(test):
            self.run.reporter.stage(self.stage)
            self.feats = self.scorer.batcher.features(self.scorer.computer, test, range(len(test)), "test")
        return self.feats


def attempt_figures(rank_stats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' `compute` statistics that say how fast the scoring went, merged."""
    slowest = max(rank_stats, key=lambda s: s["seconds"])
    return {
        "seconds": slowest["seconds"],
        "fit_seconds": slowest.get("fit_seconds", 0.0),  # the same rank's, so that the rate leaves out its own fit
        "computed": sum(s["computed"] for s in rank_stats),
        "from_cache": sum(s.get("from_cache", 0) for s in rank_stats),
        "final_batch_size": next((s["final_batch_size"] for s in rank_stats if s["final_batch_size"]), None),
    }


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
    lengths = train.tokens()[rows]
    return rows[torch.sort(-lengths, stable=True).indices].tolist()


def _feature_size(computer: GradientComputer, projector: Projector | None) -> int:
    """Numbers per example gradient: the parameter count, or its projected size."""
    if computer.factored is not None:
        return computer.factored.size()
    shapes = dict(computer.model.named_parameters())
    if projector is None:
        return count_parameters(computer.model, computer.names)
    return sum(projector.size(tuple(shapes[n].shape)) for n in computer.names)
