"""The training-gradient cache: a run that fills it and runs that read it give identical scores; a new test set
reads every training block; a missing or damaged block is computed again; checkpoints are known by their
content; entries are listed and cleared."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from test_tracin_support import bert_adapter, save_checkpoints, text_dataset

from gpuopt_tui.core.caches import gradients as gradient_cache
from gpuopt_tui.jobs.tracin import TracInOptions, select_parameters, tracin_scores
from gpuopt_tui.jobs.tracin.grad_cache import CheckpointGradients, TrainGradientCache, rounded, to_features
from gpuopt_tui.jobs.tracin.grads import GradFeatures, GradientComputer


def test_cached_and_uncached_runs_give_identical_scores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    adapter = bert_adapter(torch.float64)
    checkpoints = save_checkpoints(adapter, tmp_path)
    train, test = text_dataset(adapter, 11, seed=1), text_dataset(adapter, 4, seed=2)
    other_test = text_dataset(adapter, 3, seed=5)
    names = select_parameters(adapter, test.batch([0]), "all")
    root = tmp_path / "cache"
    options = TracInOptions(
        method="factored", projection_in=6, projection_out=6, shard_size=4, train_cache=root, batch_size=2
    )
    first = tracin_scores(adapter, checkpoints, train, test, names, options)
    assert first.stats["cache_blocks"] == {"read": 0, "computed": 9}  # 3 blocks x 3 checkpoints
    assert (first.stats["computed"], first.stats["from_cache"]) == (11 * 3, 0)  # gradients: rows x checkpoints
    # the last micro-batch's size, as without the cache (a block is 4 rows, or 3)
    plain = tracin_scores(adapter, checkpoints, train, test, names, dataclasses.replace(options, train_cache=None))
    assert first.stats["final_batch_size"] == plain.stats["final_batch_size"] < 3

    computed: list[int] = []
    original = GradientComputer.features
    monkeypatch.setattr(
        GradientComputer, "features", lambda self, b: computed.append(len(b["labels"])) or original(self, b)
    )
    again = tracin_scores(adapter, checkpoints, train, test, names, options)
    assert torch.equal(again.matrix, first.matrix) and torch.equal(again.self_influence, first.self_influence)
    assert again.stats["cache_blocks"] == {"read": 9, "computed": 0}
    assert again.stats["final_batch_size"] is None  # no micro-batch of training rows ran
    assert (again.stats["computed"], again.stats["from_cache"]) == (0, 11 * 3)  # a read is not a computation
    assert sum(computed) == len(test) * len(checkpoints)  # only the test examples' gradients

    entries = gradient_cache.entries(root)
    assert len(entries) == len(checkpoints) and all(e.blocks == 3 for e in entries)
    next(root.glob("*/block_00001.safetensors")).unlink()  # an interrupted run: one block missing
    resumed = tracin_scores(adapter, checkpoints, train, other_test, names, options)
    assert resumed.stats["cache_blocks"] == {"read": 8, "computed": 1}
    assert resumed.stats["computed"] + resumed.stats["from_cache"] == 11 * 3 and 0 < resumed.stats["computed"] <= 4
    uncached = tracin_scores(
        adapter, checkpoints, train, other_test, names, dataclasses.replace(options, train_cache=None)
    )
    assert torch.allclose(resumed.matrix, uncached.matrix, rtol=2e-2, atol=1e-3 * float(uncached.matrix.abs().max()))

    assert gradient_cache.clear(root).removed == len(checkpoints) and gradient_cache.entries(root) == []


def test_a_block_reads_back_as_stored_and_a_damaged_one_is_a_miss(tmp_path: Path) -> None:
    entry = CheckpointGradients(tmp_path, {"model": "m"})
    gen = torch.Generator().manual_seed(0)
    feats = GradFeatures(
        torch.randn(3, 5, generator=gen, dtype=torch.float64),
        [
            (
                torch.randn(3, 2, generator=gen, dtype=torch.float64),
                torch.randn(3, 4, generator=gen, dtype=torch.float64),
            )
        ],
    )
    entry.save(0, [4, 5, 6], feats)
    stored, problem = entry.read(0, [4, 5, 6], pin=False)
    assert stored is not None and problem is None
    back, want = to_features(stored, torch.device("cpu"), torch.float64), rounded(feats)
    assert torch.equal(back.dense, want.dense)
    assert all(torch.equal(x, y) for pair, other in zip(back.outer, want.outer) for x, y in zip(pair, other))
    assert entry.read(0, [4, 5, 7], pin=False) == (None, None)  # stored for other rows: a plain miss
    assert entry.read(1, [4, 5, 6], pin=False) == (None, None)  # not stored
    path = next(tmp_path.glob("*/block_00000.safetensors"))
    path.write_bytes(path.read_bytes()[:-8])
    stored, problem = entry.read(0, [4, 5, 6], pin=False)
    assert stored is None and problem is not None and "do not fit the file" in problem


def test_a_checkpoint_is_known_by_its_content(tmp_path: Path) -> None:
    checkpoint, copy = tmp_path / "step1.safetensors", tmp_path / "copy.safetensors"
    checkpoint.write_bytes(b"weights")
    copy.write_bytes(b"weights")

    def folder(path: Path) -> Path:
        with TrainGradientCache(tmp_path / "cache", {"model": "m"}, torch.device("cpu"), torch.float32) as cache:
            cache.checkpoint(path)
            return cache._current[1].folder  # type: ignore[index,union-attr]

    first = folder(checkpoint)
    assert folder(copy) == first
    checkpoint.write_bytes(b"weightz")
    assert folder(checkpoint) != first


def test_a_checkpoint_that_changes_during_the_run_is_scored_without_the_cache(tmp_path: Path) -> None:
    checkpoint = tmp_path / "step1.safetensors"
    checkpoint.write_bytes(b"weights")
    warned: list[str] = []
    feats = GradFeatures(torch.ones(2, 3), [])
    root = tmp_path / "cache"
    with TrainGradientCache(root, {"model": "m"}, torch.device("cpu"), torch.float32, warned.append) as cache:
        cache.expect([(checkpoint, 0, [0, 1])])  # hashed here
        checkpoint.write_bytes(b"new weights")  # ... and replaced before it is loaded
        cache.checkpoint(checkpoint)
        assert cache.block(0, [0, 1], lambda: feats).dense.equal(feats.dense)
    assert len(warned) == 1 and str(checkpoint) in warned[0]
    assert cache.computed == 1 and not list(root.glob("*/block_*"))
