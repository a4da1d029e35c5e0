"""Checkpoints read ahead in a background thread: the same scores and the same errors as reading each one
when it is needed."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import torch
from test_tracin_support import bert_adapter, max_rel_error, save_checkpoints, text_dataset
from torch import Tensor

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.models.base import Adapter, Checkpoint
from gpuopt_tui.jobs.tracin import MemoryStore, TracInOptions, select_parameters, tracin_scores
from gpuopt_tui.jobs.tracin.prefetch import CheckpointLoader

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    adapter = bert_adapter(torch.float64)
    checkpoints = save_checkpoints(adapter, tmp_path_factory.mktemp("ckpt"))
    train, test = text_dataset(adapter, 11, seed=31), text_dataset(adapter, 3, seed=32)
    names = select_parameters(adapter, test.batch([0]), "last", 2)
    return adapter, checkpoints, train, test, names


def reads(monkeypatch: pytest.MonkeyPatch, adapter: Adapter) -> list[tuple[str, str]]:
    """(file name, thread name) of every checkpoint read."""
    seen: list[tuple[str, str]] = []
    original = adapter.read_weights

    def spy(path: Path) -> dict[str, Tensor]:
        seen.append((Path(path).name, threading.current_thread().name))
        return original(path)

    monkeypatch.setattr(adapter, "read_weights", spy)
    return seen


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tracin-prefetch")]


def test_prefetched_checkpoints_give_the_same_scores(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    adapter, checkpoints, train, test, names = setup
    options = TracInOptions(batch_size=4, shard_size=5)
    serial = tracin_scores(adapter, checkpoints, train, test, names, dataclasses.replace(options, prefetch=False))
    seen = reads(monkeypatch, adapter)
    ahead = tracin_scores(adapter, checkpoints, train, test, names, options)
    assert torch.equal(ahead.matrix, serial.matrix)
    assert torch.equal(ahead.self_influence, serial.self_influence)
    assert ahead.stats["checkpoints_loaded"] == len(checkpoints)
    # each file read once, in order; all but the first while the checkpoint before it was being scored
    assert [name for name, _ in seen] == [c.path.name for c in checkpoints]
    assert seen[0][1] == threading.current_thread().name
    assert all(thread.startswith("tracin-prefetch") for _, thread in seen[1:])
    assert not prefetch_threads()


def test_loader_applies_each_file_in_order(setup) -> None:
    adapter, checkpoints, *_ = setup
    with CheckpointLoader(adapter, [c.path for c in checkpoints]) as loader:
        for ckpt in checkpoints:
            assert loader.load_next() == ckpt.path
            weights = adapter.model.classifier.weight.detach().clone()
            expected = adapter.read_weights(ckpt.path)["classifier.weight"]
            assert torch.equal(weights, expected)


@pytest.mark.parametrize(
    ("broken", "message"),
    [("garbage", "cannot read the checkpoint"), ("missing", "checkpoint file not found")],
)
def test_a_checkpoint_that_fails_to_read_ahead_raises_the_same_user_error(
    setup, tmp_path: Path, broken: str, message: str
) -> None:
    """The second file is read in the background thread; its error comes out when that checkpoint is due, and
    the first checkpoint's sums are saved as without prefetching."""
    adapter, checkpoints, train, test, names = setup
    bad = tmp_path / "bad.safetensors"
    if broken == "garbage":
        bad.write_bytes(b"not a checkpoint")
    plan = [checkpoints[0], Checkpoint(bad, 0.2), checkpoints[2]]
    errors, stores = [], []
    for prefetch in (False, True):
        store = MemoryStore()
        with pytest.raises(UserError, match=message) as caught:
            tracin_scores(adapter, plan, train, test, names, TracInOptions(prefetch=prefetch), store=store)
        errors.append(str(caught.value))
        stores.append(sorted(store.shards))
    assert errors[0] == errors[1] and str(bad) in errors[1]
    assert stores[0] == stores[1] == ["tracin_c000_b00000.safetensors"]
    assert not prefetch_threads()


def test_a_checkpoint_that_does_not_fit_the_model_is_a_user_error(setup, tmp_path: Path) -> None:
    adapter, checkpoints, train, test, names = setup
    state = adapter.read_weights(checkpoints[1].path)
    state.pop("classifier.bias")
    other = tmp_path / "other.pt"
    torch.save(state, other)
    plan = [checkpoints[0], Checkpoint(other, 0.2)]
    with pytest.raises(UserError, match=r"other.pt: does not match model .*missing classifier.bias"):
        tracin_scores(adapter, plan, train, test, names)
    assert not prefetch_threads()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_read_ahead_is_page_locked_and_scores_are_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    adapter = bert_adapter(torch.float32, device=device)
    checkpoints = save_checkpoints(adapter, tmp_path)
    train, test = text_dataset(adapter, 40, seed=33), text_dataset(adapter, 5, seed=34)
    names = select_parameters(adapter, {k: v.to(device) for k, v in test.batch([0]).items()}, "last", 2)
    assert all(t.is_pinned() for t in adapter.read_weights(checkpoints[0].path).values())
    serial = tracin_scores(adapter, checkpoints, train, test, names, TracInOptions(prefetch=False))
    seen = reads(monkeypatch, adapter)
    ahead = tracin_scores(adapter, checkpoints, train, test, names)
    assert max_rel_error(ahead.matrix, serial.matrix) < 1e-5  # a wrong checkpoint would be off by far more
    assert max_rel_error(ahead.self_influence, serial.self_influence) < 1e-5
    assert all(thread.startswith("tracin-prefetch") for _, thread in seen[1:]) and len(seen) == 3
