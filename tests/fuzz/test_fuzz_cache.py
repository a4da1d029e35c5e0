"""TracIn's training-gradient cache, its block files damaged at random (cut short, random bytes, edited bytes,
other shapes or dtypes under the original metadata, blocks swapped within and across checkpoints, metadata
missing or edited, a folder in a block's place): the run's scores equal, bit for bit, those of the run that
filled the cache, or the run refuses with a message naming a file; every warning names a file or the cache
folder; the next run finds the cache whole again. Each input is bounded in time."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.common import DataSection
from gpuopt_tui.jobs.data import TextDataset, load_dataset
from gpuopt_tui.jobs.models.base import Checkpoint
from gpuopt_tui.jobs.models.hf import load_hf_adapter
from gpuopt_tui.jobs.tracin import TracInOptions, select_parameters
from gpuopt_tui.jobs.tracin.interface import InfluenceResult, Reporter
from gpuopt_tui.jobs.tracin.scores import TracInRun

from .inputs import FUZZ, damaged

SECONDS_PER_INPUT = 30.0  # a run takes well under a second; generous for a loaded 2-core machine
WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "under", "red", "blue", "big", "small"]


class Warnings(Reporter):
    def __init__(self) -> None:
        self.messages: list[str] = []

    def warn(self, message: str) -> None:
        self.messages.append(message)


class World:
    """A tiny BERT, two checkpoints, 11 training and 4 test examples, and the cache a first run filled."""

    def __init__(self, scratch: Path, model_dir: Path) -> None:
        self.adapter = load_hf_adapter(model_dir, torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        self.checkpoints = []
        for i, lr in enumerate((0.5, 0.2)):
            state = {
                k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in self.adapter.model.state_dict().items()
            }
            path = scratch / f"ckpt{i}.safetensors"
            save_file({k: v.contiguous() for k, v in state.items()}, str(path))
            self.checkpoints.append(Checkpoint(path, lr))
        self.train, self.test = (self._data(scratch / f"{name}.jsonl", n) for name, n in (("train", 11), ("test", 4)))
        self.names = select_parameters(self.adapter, self.test.batch([0]), "last", 2)
        self.pristine = scratch / "pristine"
        self.reference = self.run(self.pristine, Warnings())
        self.blocks = sorted(self.pristine.glob("*/block_*.safetensors"))

    def _data(self, path: Path, n: int) -> TextDataset:
        gen = torch.Generator().manual_seed(n)
        lines = []
        for _ in range(n):
            words = torch.randint(0, len(WORDS), (int(torch.randint(2, 8, (1,), generator=gen)),), generator=gen)
            label = int(torch.randint(0, 3, (1,), generator=gen))
            lines.append(json.dumps({"text": " ".join(WORDS[int(w)] for w in words), "label": label}))
        path.write_text("\n".join(lines) + "\n")
        return load_dataset(DataSection(source="jsonl", path=str(path)), self.adapter)

    def run(self, root: Path, reporter: Reporter) -> InfluenceResult:
        options = TracInOptions(method="closed_form", shard_size=4, batch_size=4, train_cache=root)
        run = TracInRun(self.adapter, self.checkpoints, self.train, self.test, self.names, options, reporter=reporter)
        return run.gather([run.compute()])


@pytest.fixture(scope="module")
def world(scratch: Path, tiny_bert_dir: Path) -> World:
    return World(scratch, tiny_bert_dir)


def _metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as f:
        return f.metadata() or {}


def _retensor(change: Callable[[dict[str, torch.Tensor]], None], keep_metadata: bool) -> Callable[[Path], None]:
    """A damage that rewrites the block's tensors, under its original metadata or none."""

    def damage(path: Path) -> None:
        tensors, metadata = load_file(path), _metadata(path)
        change(tensors)
        save_file(tensors, str(path), metadata=metadata if keep_metadata else None)

    return damage


def _swap(other: Path) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        if not other.is_file():  # a folder by an earlier damage
            return
        mine, theirs = path.read_bytes(), other.read_bytes()
        path.write_bytes(theirs)
        other.write_bytes(mine)

    return damage


def _edit_metadata(key: str, value: str) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        metadata = {**_metadata(path), key: value}
        save_file(load_file(path), str(path), metadata=metadata)

    return damage


def _folder(path: Path) -> None:
    path.unlink()
    path.mkdir()


@st.composite
def damages(draw: st.DrawFn, blocks: list[Path]) -> tuple[int, Callable[[Path], None]]:
    """(which block, how it is damaged); a damage is a function of the block's path in the damaged cache."""
    index = draw(st.integers(0, len(blocks) - 1))
    good = blocks[index].read_bytes()
    kind = draw(
        st.sampled_from(
            ["cut", "bytes", "edits", "shape", "dtype", "rows", "swap", "no_metadata", "metadata", "header", "folder"]
        )
    )
    if kind == "cut":
        size = draw(st.integers(0, len(good) - 1))
        return index, lambda p: p.write_bytes(good[:size])
    if kind == "bytes":
        noise = draw(st.binary(max_size=300))
        return index, lambda p: p.write_bytes(noise)
    if kind == "edits":
        edited = draw(damaged(good))
        return index, lambda p: p.write_bytes(edited)
    if kind == "shape":
        name, cut = draw(st.sampled_from(["dense", "g0", "a1"])), draw(st.integers(1, 3))
        change = lambda t: t.update({name: t[name][:, cut:].contiguous()})  # noqa: E731
        return index, _retensor(change, keep_metadata=draw(st.booleans()))
    if kind == "dtype":
        name = draw(st.sampled_from(["dense", "g1", "rows"]))
        return index, _retensor(lambda t: t.update({name: t[name].float()}), keep_metadata=draw(st.booleans()))
    if kind == "rows":
        return index, _retensor(lambda t: t.update({"rows": t["rows"].flip(0)}), keep_metadata=True)
    if kind == "swap":
        other = draw(st.sampled_from([b for b in blocks if b != blocks[index]]))
        return index, lambda p: _swap(p.parents[1] / other.relative_to(other.parents[1]))(p)
    if kind == "no_metadata":
        return index, _retensor(lambda t: None, keep_metadata=False)
    if kind == "metadata":
        key = draw(st.sampled_from(["format", "entry", "block", "checkpoint", "train", "projection", "checksum"]))
        return index, _edit_metadata(key, draw(st.sampled_from(["", "0", "1", "2", "x" * 64])))
    if kind == "header":
        size = draw(st.sampled_from([2**64 - 1, 2**40, len(good), len(good) - 8]))
        return index, lambda p: p.write_bytes(size.to_bytes(8, "little") + good[8:])
    return index, _folder


@FUZZ
@given(data=st.data())
def test_damaged_cache_blocks(world: World, scratch: Path, data: st.DataObject) -> None:
    root = scratch / "cache"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(world.pristine, root)
    chosen = data.draw(st.lists(damages(world.blocks), min_size=1, max_size=3, unique_by=lambda d: d[0]))
    for index, damage in chosen:
        path = root / world.blocks[index].relative_to(world.pristine)
        if path.is_file():  # (not a folder left by an earlier damage)
            damage(path)
    started = time.perf_counter()
    reporter = Warnings()
    try:
        result = world.run(root, reporter)
    except UserError as error:
        assert str(root) in str(error), error
        return
    assert time.perf_counter() - started < SECONDS_PER_INPUT
    assert torch.equal(result.matrix, world.reference.matrix)
    assert torch.equal(result.self_influence, world.reference.self_influence)
    assert all(message.startswith(str(root)) for message in reporter.messages), reporter.messages
    blocks = result.stats["cache_blocks"]
    assert blocks["read"] + blocks["computed"] == len(world.blocks)

    again = Warnings()  # damaged blocks were stored anew (where a block's place is not taken by a folder)
    whole = world.run(root, again)
    assert torch.equal(whole.matrix, world.reference.matrix)
    unwritable = [m for m in reporter.messages if "cannot store" in m]
    assert whole.stats["cache_blocks"]["read"] == len(world.blocks) or unwritable, (reporter.messages, again.messages)
