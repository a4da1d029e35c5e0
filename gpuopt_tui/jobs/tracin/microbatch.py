"""Feeding examples to a `GradientComputer` in micro-batches that fit the GPU memory, and freeing cached GPU
memory now and then for other processes."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch import Tensor
from torch.profiler import record_function

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.attribution.chunking import ChunkPlanner
from gpuopt_tui.jobs.data import TextDataset, trim_batch
from gpuopt_tui.jobs.device import free_memory, is_oom
from gpuopt_tui.jobs.models.base import to_device
from gpuopt_tui.jobs.tracin.grads import GradFeatures, GradientComputer
from gpuopt_tui.jobs.tracin.interface import Reporter


class MicroBatcher:
    """Feeds rows of a dataset to a `GradientComputer` in micro-batches sized by a `ChunkPlanner` (one
    "step" = one example): a fixed size, or "auto", where on a GPU the first micro-batch is a memory probe
    and later ones fill a share of the free memory. On out-of-memory the size is halved for the rest of the
    run and the micro-batch retried."""

    def __init__(self, size: int | Literal["auto"], reporter: Reporter) -> None:
        self.planner = ChunkPlanner(size, on_event=self._planner_event)
        self.reporter = reporter
        self.ooms = 0
        self.last_size: dict[str, int] = {}  # what ("train", "test") -> the size of its last micro-batch
        self._lengths: dict[int, Tensor] = {}  # id(dataset) -> real tokens per example, computed once

    def run(
        self, computer: GradientComputer, ds: TextDataset, rows: Sequence[int], what: str
    ) -> Iterator[tuple[int, GradFeatures]]:
        """(offset into `rows`, features of the micro-batch starting there); `what` names the examples
        ("train", "test") in profiler traces."""
        device = computer.adapter.device
        lengths = self._lengths.setdefault(id(ds), ds.tokens())
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
            self.last_size[what] = size
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

    def features(
        self,
        computer: GradientComputer,
        ds: TextDataset,
        rows: Sequence[int],
        what: str,
        on_rows: Callable[[int], None] | None = None,
    ) -> GradFeatures:
        """The features of every row, gathered in one preallocated block (no second copy); `on_rows(rows done)`
        after each micro-batch."""
        out: GradFeatures | None = None
        for offset, part in self.run(computer, ds, rows, what):
            out = out if out is not None else GradFeatures.empty(part, len(rows))
            out.put(offset, part)
            if on_rows is not None:
                on_rows(offset + len(part))
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
