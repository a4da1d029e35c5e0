"""What the TracIn engine (scores.py) takes and gives: its options, its result, and the reporter it tells its
progress and asks whether to stop."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torch import Tensor


@dataclass
class TracInOptions:
    method: str = "auto"  # auto | closed_form | vmap | factored (see grads.py)
    precision: str = "fp32"  # forward precision: fp32, bf16 or fp16 (jobs.device.autocast)
    projection_dim: int = 0  # closed_form, vmap: 0 = exact gradients
    projection_in: int = 0  # factored: projected size of each layer's input side (0 = exact)
    projection_out: int = 0  # factored: projected size of each layer's output side (0 = exact)
    seed: int = 0  # projection seed
    projection_basis: str = "random"  # factored: random | pca (pca_basis.py: fitted at each checkpoint)
    pca_examples: int = 256  # pca: the first this many training examples
    # pca: directions to use, by checkpoint file, instead of fitting them (a run's own, for its agreement check)
    fitted_bases: dict[Path, dict[tuple[str, int], Tensor]] | None = None
    optimizer_state: str = "off"  # off | adam: Adam-preconditioned training gradients (adam_state.py)
    batch_size: int | Literal["auto"] = "auto"  # micro-batch (examples), halved on out-of-memory
    gradient_checkpointing: bool = False
    cleanup_every: int = 0  # examples between memory clean-ups (0 = never)
    prefetch: bool = True  # read the next checkpoint's file while the current checkpoint is scored
    shard_size: int = 4096  # training examples per saved block
    top_k: int = 10
    keep_matrix: bool = True  # return the full [n_test, n_scored] score matrix
    train_cache: Path | None = None  # keep the training gradients there (core/caches/gradients.py) and reuse them
    # PEFT adapter checkpoints: what else the weights are made of (the base model's weights digest, the adapter's
    # configuration), which the cached training gradients depend on besides the checkpoint files
    adapter_base: dict[str, Any] | None = None


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
    query_mean: Tensor | None = None  # [M] mean score over the test examples (dataset_ranking.py), NaN: none scored
    query_max: Tensor | None = None  # [M] max score over them
    query_count: Tensor | None = None  # [M] how many test examples each was scored against
    stats: dict[str, Any] = field(default_factory=dict)


class Reporter:
    """Where the engine reports progress, events and warnings and asks whether to stop; this one ignores all but
    the warnings."""

    def progress(self, done: int, total: int, stage: str) -> None:
        pass

    def stage(self, name: str) -> None:
        """What the engine does now where it has no count (loading a checkpoint, the test gradients)."""

    def event(self, type: str, **fields: Any) -> None:
        pass

    def warn(self, message: str) -> None:
        """Something the user should know (a damaged cache block that was computed again): a Python warning."""
        warnings.warn(message, stacklevel=2)

    def check_cancelled(self) -> None:
        pass


class PrefixedReporter(Reporter):
    """Passes everything on to `inner`, with `prefix` before each stage name (a second computation in the
    same run, e.g. the agreement check, says which one it is)."""

    def __init__(self, inner: Reporter, prefix: str) -> None:
        self.inner, self.prefix = inner, prefix

    def progress(self, done: int, total: int, stage: str) -> None:
        self.inner.progress(done, total, f"{self.prefix}: {stage}")

    def stage(self, name: str) -> None:
        self.inner.stage(f"{self.prefix}: {name}")

    def event(self, type: str, **fields: Any) -> None:
        self.inner.event(type, **fields)

    def warn(self, message: str) -> None:
        self.inner.warn(message)

    def check_cancelled(self) -> None:
        self.inner.check_cancelled()
