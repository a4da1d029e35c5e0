"""The training-gradient cache never serves damaged or stale blocks: a block that is not exactly what this run
would compute (another shape, another block's content, another checkpoint's) is computed again with a warning
that names its file; a checkpoint is known by its content, however its file was replaced; a cache folder that
cannot be written leaves the run going without the cache, with a warning that names the folder."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from test_tracin_support import bert_adapter, save_checkpoints, text_dataset

from gpuopt_tui.jobs.tracin import TracInOptions, block_file, select_parameters, tracin_scores
from gpuopt_tui.jobs.tracin.interface import InfluenceResult, Reporter


class Warnings(Reporter):
    def __init__(self) -> None:
        self.messages: list[str] = []

    def warn(self, message: str) -> None:
        self.messages.append(message)


@dataclasses.dataclass
class Setup:
    args: tuple[Any, ...]
    options: TracInOptions
    root: Path

    def run(self, reporter: Reporter | None = None, root: Path | None = None) -> InfluenceResult:
        options = dataclasses.replace(self.options, train_cache=root or self.root)
        return tracin_scores(*self.args, options, reporter=reporter or Warnings())


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    adapter = bert_adapter(torch.float64)
    checkpoints = save_checkpoints(adapter, tmp_path, lrs=(0.5, 0.3))
    train, test = text_dataset(adapter, 11, seed=1), text_dataset(adapter, 4, seed=2)
    names = select_parameters(adapter, test.batch([0]), "last", 2)
    options = TracInOptions(method="closed_form", shard_size=4, batch_size=4)
    return Setup((adapter, checkpoints, train, test, names), options, tmp_path / "cache")


def same_scores(result: InfluenceResult, reference: InfluenceResult) -> bool:
    return torch.equal(result.matrix, reference.matrix) and torch.equal(result.self_influence, reference.self_influence)


def blocks(root: Path, name: str) -> list[Path]:
    """The file of block `name` in each checkpoint's entry."""
    return sorted(root.glob(f"*/{name}"))


def rewrite(path: Path, change: dict[str, torch.Tensor]) -> None:
    """The block's tensors with `change` applied, saved as a plain safetensors file (no metadata)."""
    save_file({**load_file(path), **change}, str(path))


def test_a_block_of_another_shape_is_computed_again_with_a_warning(setup: Setup) -> None:
    reference = setup.run()
    path = blocks(setup.root, "block_00001.safetensors")[0]
    dense = load_file(path)["dense"]
    rewrite(path, {"dense": dense[:, :-1].clone()})  # the right rows, a dense part one column short
    reporter = Warnings()
    result = setup.run(reporter)
    assert same_scores(result, reference)
    assert result.stats["cache_blocks"] == {"read": 5, "computed": 1}
    assert len(reporter.messages) == 1 and str(path) in reporter.messages[0]
    assert same_scores(setup.run(), reference) and setup.run().stats["cache_blocks"]["computed"] == 0  # rewritten


def test_a_block_holding_another_blocks_content_is_not_used(setup: Setup) -> None:
    reference = setup.run()
    first, second = (blocks(setup.root, f"block_0000{j}.safetensors")[0] for j in (0, 1))
    rows = load_file(second)["rows"]
    shutil.copyfile(first, second)  # block 0's gradients (4 rows too) ...
    rewrite(second, {"rows": rows})  # ... under block 1's rows
    reporter = Warnings()
    result = setup.run(reporter)
    assert same_scores(result, reference)
    assert result.stats["cache_blocks"] == {"read": 5, "computed": 1}
    assert any(str(second) in m for m in reporter.messages)


def test_blocks_swapped_between_checkpoints_or_positions_are_not_used(setup: Setup) -> None:
    reference = setup.run()
    a, b = blocks(setup.root, "block_00000.safetensors")  # the same block of the two checkpoints
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    third = a.parent / "block_00002.safetensors"
    third.write_bytes(a.parent.joinpath("block_00001.safetensors").read_bytes())  # wrong rows, wrong position
    reporter = Warnings()
    result = setup.run(reporter)
    assert same_scores(result, reference)
    assert result.stats["cache_blocks"] == {"read": 3, "computed": 3}
    assert all(any(str(p) in m for m in reporter.messages) for p in (a, b, third))


def test_a_checkpoint_replaced_in_place_with_its_mtime_restored_is_not_served_from_the_cache(setup: Setup) -> None:
    setup.run()
    path = setup.args[1][0].path
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[-8:] = bytes(8)  # other weights, same size, written into the same file (same inode)
    with path.open("r+b") as f:
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns, path.stat().st_ino) == (
        before.st_size,
        before.st_mtime_ns,
        before.st_ino,
    )
    result = setup.run()
    assert result.stats["cache_blocks"] == {"read": 3, "computed": 3}  # the first checkpoint's blocks anew
    uncached = setup.run(root=setup.root.parent / "fresh")
    assert same_scores(result, uncached)


def test_a_cache_folder_that_is_a_file_leaves_the_run_going_without_it(setup: Setup) -> None:
    reference = setup.run(root=setup.root.parent / "reference")
    setup.root.write_text("not a folder")
    reporter = Warnings()
    result = setup.run(reporter)
    assert same_scores(result, reference)
    assert len(reporter.messages) == 1, reporter.messages
    assert str(setup.root) in reporter.messages[0] and "train_cache = false" in reporter.messages[0]
    assert setup.root.read_text() == "not a folder"


def test_a_cache_folder_that_cannot_be_written_leaves_the_run_going_without_it(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = setup.run(root=setup.root.parent / "reference")

    def refuse(tensors: dict[str, torch.Tensor], filename: str, **kwargs: Any) -> None:
        # what safetensors raises in a read-only folder (simulated: the tests may run as root, who may write there)
        raise SafetensorError(f"Error while serializing: I/O error: Permission denied (os error 13) at {filename}")

    monkeypatch.setattr(block_file, "save_file", refuse)
    reporter = Warnings()
    result = setup.run(reporter)
    assert same_scores(result, reference)
    assert len(reporter.messages) == 1, reporter.messages
    assert str(setup.root) in reporter.messages[0] and "Permission denied" in reporter.messages[0]
