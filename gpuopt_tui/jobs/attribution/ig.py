"""Batched Integrated Gradients: all samples of a batch x a chunk of interpolation steps per pass."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor, nn

from gpuopt_tui.jobs.attribution.adaptive import (
    check_max_steps,
    full_precision,
    needs_full_precision,
    precision_floor,
    settled,
)
from gpuopt_tui.jobs.attribution.chunking import ChunkPlanner
from gpuopt_tui.jobs.attribution.common import (
    ForwardFn,
    IGResult,
    Target,
    accumulation_dtype,
    endpoint_outputs,
    finish,
    frozen_parameters,
    module_of,
    path_attributions,
    resolve_endpoint_precision,
    resolve_target,
    selected,
)
from gpuopt_tui.jobs.attribution.compiled import StepCompiler
from gpuopt_tui.jobs.attribution.panels import GRID, NEW_POINTS, SamplePanels, first_positions
from gpuopt_tui.jobs.attribution.precision import REDUCED, StepPrecision, check_finite, weights_cast
from gpuopt_tui.jobs.attribution.rules import step_rule
from gpuopt_tui.jobs.device import autocast, free_memory, is_oom
from gpuopt_tui.jobs.models.base import tile_rows


def integrated_gradients(
    forward: ForwardFn,
    inputs_embeds: Tensor,
    baselines: Tensor,
    attention_mask: Tensor | None = None,
    target: Target = "predicted",
    *,
    n_steps: int | Literal["auto"] = 50,
    method: str = "gausslegendre",
    tolerance: float = 1e-2,
    max_steps: int = 1025,
    alpha_batch_size: int | Literal["auto"] | ChunkPlanner | None = None,
    precision: str = "fp32",
    cast_weights: bool = False,
    full_precision_fallback: bool = False,
    per_dimension: bool = True,
    compiler: StepCompiler | None = None,
    endpoint_precision: str | None = None,
    context: Mapping[str, Tensor] | None = None,
    model: nn.Module | None = None,
    on_chunk: Callable[[int, int], None] | None = None,
) -> IGResult:
    """Integrated Gradients of `forward` with respect to `inputs_embeds` [B, *S, H].

    Interpolated points are laid out step-major (row k*B+i is step k of sample i) and processed in chunks of
    whole steps for all samples (`alpha_batch_size` steps, "auto" to fit the GPU memory, None for all at
    once, or a shared `ChunkPlanner`); a chunk that runs out of GPU memory is halved and retried. The
    forward runs under `precision` ("fp32", "tf32", "bf16", "fp16" autocast), or with `cast_weights` and
    bf16/fp16 on a copy of the weights in that dtype without autocast (see precision.py); with a
    `compiler`, that forward is torch.compile'd (see compiled.py). Gradients come from
    `torch.autograd.grad` with respect to the interpolated embeddings only (the parameters of `model`, by
    default the forward's own module, are frozen meanwhile) and are weighted and summed in fp32.
    With `n_steps = "auto"` each sample is refined on adaptive Simpson panels until its relative completeness
    delta and the error estimate of its token scores are within `tolerance` (raised to what `precision` can
    resolve), or one more pass would take it over `max_steps` (see adaptive.py; `method` is not used); each
    refinement pass runs the unconverged samples only, each at its own new points. With
    `full_precision_fallback` and bf16/fp16 steps, the samples whose output moves too little for those steps to
    reach the tolerance (adaptive.needs_full_precision) run theirs in TF32/fp32 (adaptive.full_precision),
    eagerly; the result's `full_precision` marks them.
    Without `per_dimension` the attributions are summed over the embedding dimension ([B, *S, 1], the token
    scores): with "auto" steps the engine then keeps no gradient, only each token's integrand at each point
    (memory that does not grow with the embedding size); by default every gradient of a batch is kept until its
    panels are final.
    F(x) and F(baseline) (and so the target, the prediction and the convergence deltas) run eagerly on the
    original weights, never autocast: in fp32 by default, or "tf32" with `endpoint_precision`.
    `context` tensors (first dim B) are tiled to the rows of each chunk and handed to the forward.
    `on_chunk(done, total)` is called after every chunk (e.g. to check for cancellation).
    The model should be in eval mode (dropout would make the path integral random).
    """
    if baselines.shape != inputs_embeds.shape:
        raise ValueError(f"baselines {tuple(baselines.shape)} differ from inputs {tuple(inputs_embeds.shape)}")
    planner = alpha_batch_size if isinstance(alpha_batch_size, ChunkPlanner) else ChunkPlanner(alpha_batch_size)
    acc = accumulation_dtype(inputs_embeds)
    inputs, baselines = inputs_embeds.detach().to(acc), baselines.detach().to(acc)
    batch = inputs.shape[0]
    step = StepPrecision.of(precision, cast_weights)
    module = module_of(forward, model)

    with frozen_parameters(module):
        endpoints = resolve_endpoint_precision(endpoint_precision)
        out_x, out_b = endpoint_outputs(forward, inputs, baselines, attention_mask, dict(context or {}), endpoints)
        target = resolve_target(target, out_x)
        rows = _Chunk(baselines, inputs - baselines, inputs.new_zeros(0), attention_mask, dict(context or {}), target)
        full = torch.zeros(batch, dtype=torch.bool, device=inputs.device)
        if n_steps == "auto":
            ends = selected(out_x, target), selected(out_b, target)
            if full_precision_fallback and precision in REDUCED:
                full = needs_full_precision(*ends, tolerance, precision, acc)
            total = rows.diff.new_zeros(batch, rows.diff[0].numel() if per_dimension else rows.tokens)
            steps = torch.zeros(batch, dtype=torch.long, device=inputs.device)
            groups = [(m, p) for m, p in ((~full, precision), (full, full_precision(tolerance))) if bool(m.any())]
            for part, (members, group_precision) in enumerate(groups):
                index = members.nonzero().squeeze(1)
                group_step = step if group_precision == precision else StepPrecision.of(group_precision)
                group_compiler = compiler if group_step is step else None  # the compiled graph is the main group's
                passes = _Passes(forward, group_step, planner, group_compiler, on_chunk)
                with weights_cast(module, group_step.weights):
                    total[index], steps[index] = _refined(
                        passes,
                        rows.select(index).in_precision(group_step),
                        (ends[0][index], ends[1][index]),
                        tolerance,
                        max_steps,
                        precision_floor(group_precision, acc),
                        share=(part, len(groups)),
                        per_dimension=per_dimension,
                    )
        else:
            passes = _Passes(forward, step, planner, compiler, on_chunk)
            alphas, weights = (torch.as_tensor(v, dtype=acc, device=inputs.device) for v in step_rule(method, n_steps))
            with weights_cast(module, step.weights):
                total = passes.integrate(rows.in_precision(step), alphas, weights)
            steps = torch.full((batch,), n_steps, dtype=torch.long, device=inputs.device)
    check_finite(total, precision)
    if n_steps == "auto" and not per_dimension:
        attributions = total.view(*inputs.shape[:-1], 1)
    else:
        attributions = path_attributions(total.view_as(inputs), inputs, baselines)
        attributions = attributions if per_dimension else attributions.sum(-1, keepdim=True)
    return finish(attributions, out_x, out_b, target, steps, full)


PROGRESS_UNITS = 1000  # over several passes, on_chunk(done, total) counts thousandths of the batch


@dataclass
class _Passes:
    """Runs passes of the engine: every sample of some rows at some alphas."""

    forward: ForwardFn
    step: StepPrecision
    planner: ChunkPlanner
    compiler: StepCompiler | None
    on_chunk: Callable[[int, int], None] | None
    span: tuple[float, float] | None = None  # the share of the batch a pass covers; None: report its steps

    def integrate(self, rows: _Chunk, alphas: Tensor, weights: Tensor) -> Tensor:
        """[rows x numel]: the gradients at `alphas` summed with `weights` (both [steps])."""
        sums = torch.zeros(1, rows.diff.numel(), dtype=rows.diff.dtype, device=rows.diff.device)
        for start, grads in self.chunks(rows, alphas):
            sums.addmm_(weights[None, start : start + grads.shape[0]], grads.to(sums.dtype))
            del grads  # free it before the next chunk allocates its own
        return sums[0]

    def chunks(self, rows: _Chunk, alphas: Tensor) -> Iterator[tuple[int, Tensor]]:
        """(first step, gradients [steps, rows x numel]) of each chunk of the pass, in order."""
        device, n = rows.baselines.device, alphas.shape[0]
        done = 0
        while done < n:
            steps = self.planner.next_steps(n - done, rows.rows, rows.tokens, device)
            chunk = dataclasses.replace(rows, alphas=alphas[done : done + steps])
            grads = _attempt(chunk, self.forward, self.step, self.planner, self.compiler)
            if grads is None:  # retry, once the failed attempt's frames are released
                free_memory(device)
                continue
            yield done, grads
            self.planner.chunk_done(steps, rows.rows, rows.tokens, device)
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


def _refined(
    passes: _Passes,
    rows: _Chunk,
    ends: tuple[Tensor, Tensor],
    tolerance: float,
    max_steps: int,
    floor: float,
    share: tuple[int, int] = (0, 1),
    per_dimension: bool = True,
) -> tuple[Tensor, Tensor]:
    """Integrated gradients [B, numel] on adaptive panels (without `per_dimension`: the token scores [B, tokens],
    no gradient kept) and the points each sample used [B], from the explained outputs `ends` (F(x),
    F(baseline)) and the steps' precision `floor` (adaptive.py); `share` (index, parts): where these samples'
    passes are in the progress of the batch."""
    check_max_steps(max_steps)
    batch, device, dtype = rows.rows, rows.diff.device, rows.diff.dtype
    hidden = rows.diff.shape[-1]
    diff = rows.diff.reshape(batch, -1, hidden)
    samples = [SamplePanels(diff.shape[1]) for _ in range(batch)]
    ends = [end.double().tolist() for end in ends]
    evaluated: list[tuple[Tensor, np.ndarray, Tensor]] = []  # each pass: samples, positions [n, b], gradients
    active, positions = list(range(batch)), np.repeat(first_positions()[:, None], batch, axis=1)
    reached = 0.0  # the share of the samples' progress reported so far
    while active:
        reached = max(reached, 1 - len(active) / batch)
        passes.span = ((share[0] + reached) / share[1], (share[0] + (1 + reached) / 2) / share[1])
        members = torch.as_tensor(active, device=device)
        alphas = torch.as_tensor(positions / GRID, dtype=dtype, device=device)
        kept, values = [], []  # per chunk: the gradients (kept with per_dimension), each token's integrand
        for _, grads in passes.chunks(rows.select(members), alphas):
            values.append((grads.view(grads.shape[0], len(active), -1, hidden).to(dtype) * diff[members]).sum(-1))
            if per_dimension:
                kept.append(grads)
        if per_dimension:
            evaluated.append((members, positions, torch.cat(kept)))
        values = torch.cat(values).double().cpu().numpy()  # [n, b, tokens]
        reached = (1 + reached) / 2
        going, later = [], []
        for j, i in enumerate(active):
            samples[i].add(positions[:, j], values[:, j])
            done, panel_errors = settled(samples[i], (ends[0][i], ends[1][i]), tolerance, floor, dtype)
            if not done and samples[i].points + NEW_POINTS <= max_steps:
                going.append(i)
                later.append(samples[i].split(panel_errors))
        active, positions = going, np.stack(later, axis=1) if later else positions[:0]
    steps = torch.as_tensor([sample.points for sample in samples], dtype=torch.long, device=device)
    if not per_dimension:
        scores = np.stack([sample.estimate().scores for sample in samples])
        return torch.as_tensor(scores, dtype=dtype, device=device), steps
    return _weighted(samples, evaluated, diff[0].numel(), dtype), steps


def _weighted(
    samples: list[SamplePanels], evaluated: list[tuple[Tensor, np.ndarray, Tensor]], numel: int, dtype: torch.dtype
) -> Tensor:
    """[B, numel]: every pass's gradients with their points' weights in the final panels."""
    device = evaluated[0][2].device
    total = torch.zeros(len(samples), numel, dtype=dtype, device=device)
    for members, where, grads in evaluated:
        weights = [samples[i].weights() for i in members.tolist()]
        table = np.array([[w[int(p)] for w, p in zip(weights, row)] for row in where])  # [n, b]
        w = torch.as_tensor(table, dtype=dtype, device=device)
        total[members] += torch.einsum("nb,nbk->bk", w, grads.view(*w.shape, -1).to(dtype))
    return total


def _attempt(
    chunk: _Chunk, forward: ForwardFn, step: StepPrecision, planner: ChunkPlanner, compiler: StepCompiler | None
) -> Tensor | None:
    """The chunk's gradients, or None when it is to be retried: with a halved chunk size after running out of
    memory, or eagerly after a failed compilation (the compiler then stays off)."""
    device = chunk.baselines.device
    timed = compiler is not None and compiler.compiles(chunk.shape)
    start = _clock(device) if timed else 0.0
    try:
        grads = chunk.gradients(forward if compiler is None else compiler.forward(forward), step)
    except Exception as exc:
        if is_oom(exc):
            if not planner.shrink(chunk.steps, chunk.rows, chunk.tokens):
                raise
        elif compiler is not None and compiler.active:
            compiler.failed(exc)
        else:
            raise
        return None
    if timed and compiler is not None:
        compiler.compiled(_clock(device) - start)
    return grads


def _clock(device: torch.device) -> float:
    """Wall-clock seconds once the device's queued work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class _Chunk:
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
    def shape(self) -> tuple[int, ...]:
        """Shape of the points handed to the forward."""
        return (self.steps * self.rows, *self.baselines.shape[1:])

    def select(self, index: Tensor) -> _Chunk:
        """The samples at `index` only, at the same alphas (their own where they are per sample)."""
        mask = None if self.mask is None else self.mask[index]
        target = None if self.target is None else self.target[index]
        context = {k: v[index] for k, v in self.context.items()}
        alphas = self.alphas[:, index] if self.alphas.dim() == 2 else self.alphas
        return _Chunk(self.baselines[index], self.diff[index], alphas, mask, context, target)

    def in_precision(self, step: StepPrecision) -> _Chunk:
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
