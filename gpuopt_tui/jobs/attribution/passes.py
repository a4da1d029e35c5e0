"""Passes of the batched Integrated Gradients engine: every sample of some rows at some alphas, in chunks of whole
steps that fit the memory (halved and retried when a chunk runs out of it)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gpuopt_tui.jobs.attribution.chunking import ChunkPlanner
from gpuopt_tui.jobs.attribution.common import ForwardFn, selected
from gpuopt_tui.jobs.attribution.compiled import StepCompiler
from gpuopt_tui.jobs.attribution.precision import StepPrecision, weights_cast
from gpuopt_tui.jobs.device import autocast, clock, free_memory, is_oom
from gpuopt_tui.jobs.models.base import tile_rows

PROGRESS_UNITS = 1000  # over several passes, on_chunk(done, total) counts thousandths of the batch


@dataclass
class Passes:
    """Runs passes of the engine: every sample of some rows at some alphas."""

    forward: ForwardFn
    step: StepPrecision
    planner: ChunkPlanner
    compiler: StepCompiler | None
    on_chunk: Callable[[int, int], None] | None
    module: nn.Module | None = None  # whose weights `step` casts (precision.weights_cast) while a pass runs
    span: tuple[float, float] | None = None  # the share of the batch a pass covers; None: report its steps

    def integrate(self, rows: Rows, alphas: Tensor, weights: Tensor) -> Tensor:
        """[rows x numel]: the gradients at `alphas` summed with `weights` (both [steps])."""
        sums = torch.zeros(1, rows.diff.numel(), dtype=rows.diff.dtype, device=rows.diff.device)
        for start, grads in self.chunks(rows, alphas):
            sums.addmm_(weights[None, start : start + grads.shape[0]], grads.to(sums.dtype))
            del grads  # free it before the next chunk allocates its own
        return sums[0]

    def chunks(self, rows: Rows, alphas: Tensor) -> Iterator[tuple[int, Tensor]]:
        """(first step, gradients [steps, rows x numel]) of each chunk of the pass, in order; the weights stay cast
        to the step's dtype until the pass is done."""
        with weights_cast(self.module, self.step.weights):
            yield from self._chunks(rows.in_precision(self.step), alphas)

    def _chunks(self, rows: Rows, alphas: Tensor) -> Iterator[tuple[int, Tensor]]:
        device, n = rows.baselines.device, alphas.shape[0]
        done = 0
        while done < n:
            steps = self.planner.next_steps(n - done, rows.rows, rows.run_tokens, device)
            chunk = dataclasses.replace(rows, alphas=alphas[done : done + steps])
            grads = attempt(chunk, self.forward, self.step, self.planner, self.compiler)
            if grads is None:  # retry, once the failed attempt's frames are released
                free_memory(device)
                continue
            yield done, grads
            self.planner.chunk_done(steps, rows.rows, rows.run_tokens, device)
            done += steps
            if self.on_chunk is not None:
                self._report(done, n)

    def _report(self, done: int, n: int) -> None:
        assert self.on_chunk is not None
        if self.span is None:
            self.on_chunk(done, n)
        else:
            start, end = self.span
            self.on_chunk(int(PROGRESS_UNITS * (start + (end - start) * done / n)), PROGRESS_UNITS)


def attempt(
    chunk: Rows, forward: ForwardFn, step: StepPrecision, planner: ChunkPlanner, compiler: StepCompiler | None
) -> Tensor | None:
    """The chunk's gradients, or None when it is to be retried: with a halved chunk size after running out of
    memory, or eagerly after a failed compilation (the compiler then stays off)."""
    device = chunk.baselines.device
    timed = compiler is not None and compiler.compiles(chunk.shape)
    start = clock(device) if timed else 0.0
    try:
        grads = chunk.gradients(forward if compiler is None else compiler.forward(forward), step)
    except Exception as exc:
        if is_oom(exc):
            if not planner.shrink(chunk.steps, chunk.rows, chunk.run_tokens):
                raise
        elif compiler is not None and compiler.active:
            compiler.failed(exc)
        else:
            raise
        return None
    if timed and compiler is not None:
        compiler.compiled(clock(device) - start)
    return grads


@dataclass
class Rows:
    """`len(alphas)` interpolation steps for every sample of the batch."""

    baselines: Tensor  # [B, *S, H] in the accumulation dtype
    diff: Tensor  # inputs - baselines
    alphas: Tensor  # [steps], or [steps, B]: each sample's own
    mask: Tensor | None  # [B, *S]
    context: Mapping[str, Tensor]  # first dim B
    target: Tensor | None  # [B]

    @property
    def steps(self) -> int:
        return self.alphas.shape[0]

    @property
    def rows(self) -> int:
        return self.baselines.shape[0]

    @property
    def tokens(self) -> int:
        return math.prod(self.baselines.shape[1:-1])

    @property
    def run_tokens(self) -> int:
        """Positions the forward runs per row, which chunks are sized by: the attributed tokens, and the tokens of
        any sequence of embeddings the context carries beside them ([B, T, hidden]: a causal LM's completion)."""
        hidden = self.baselines.shape[-1]
        extra = sum(v.shape[1] for v in self.context.values() if v.dim() == 3 and v.shape[-1] == hidden)
        return self.tokens + extra

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the points handed to the forward."""
        return (self.steps * self.rows, *self.baselines.shape[1:])

    def select(self, index: Tensor) -> Rows:
        """The samples at `index` only, at the same alphas (their own where they are per sample)."""
        mask = None if self.mask is None else self.mask[index]
        target = None if self.target is None else self.target[index]
        context = {k: v[index] for k, v in self.context.items()}
        alphas = self.alphas[:, index] if self.alphas.dim() == 2 else self.alphas
        return Rows(self.baselines[index], self.diff[index], alphas, mask, context, target)

    def in_precision(self, step: StepPrecision) -> Rows:
        """The same rows with their floating context in the dtype `step` runs in."""
        return dataclasses.replace(self, context=step.context(self.context))

    def gradients(self, forward: ForwardFn, step: StepPrecision) -> Tensor:
        """Gradients of the explained output at every point: [steps, B * prod(S) * H] (the step dtype)."""
        steps = self.steps
        per_sample = self.alphas.dim() == 2
        scale = self.alphas.view(steps, self.rows if per_sample else 1, *([1] * (self.baselines.dim() - 1)))
        # one pass writes the points straight in the dtype the forward takes
        points = torch.empty(self.shape, dtype=step.weights or self.baselines.dtype, device=self.baselines.device)
        torch.addcmul(
            self.baselines.unsqueeze(0), scale, self.diff.unsqueeze(0), out=points.view(steps, *self.baselines.shape)
        )
        points.requires_grad_()
        mask = None if self.mask is None else tile_rows(self.mask, steps)
        with torch.enable_grad():
            with autocast(points.device, step.autocast):
                out = forward(points, mask, tile_rows(self.context, steps))
            rows_target = None if self.target is None else tile_rows(self.target, steps)
            chosen = selected(out.to(self.baselines.dtype), rows_target)
            (grads,) = torch.autograd.grad(chosen.sum(), points)
        return grads.reshape(steps, -1)
