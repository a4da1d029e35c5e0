"""Batched Integrated Gradients: all samples of a batch x a chunk of interpolation steps per pass."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

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
    resolve_endpoint_precision,
    resolve_target,
    selected,
)
from gpuopt_tui.jobs.attribution.compiled import StepCompiler
from gpuopt_tui.jobs.attribution.precision import StepPrecision, check_finite, weights_cast
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
    n_steps: int = 50,
    method: str = "gausslegendre",
    alpha_batch_size: int | Literal["auto"] | ChunkPlanner | None = None,
    precision: str = "fp32",
    cast_weights: bool = False,
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
    F(x) and F(baseline) (and so the target, the prediction and the convergence deltas) run eagerly on the
    original weights, never autocast: in fp32 by default, or "tf32" with `endpoint_precision`.
    `context` tensors (first dim B) are tiled to the rows of each chunk and handed to the forward.
    `on_chunk(done_steps, n_steps)` is called after every chunk (e.g. to check for cancellation).
    The model should be in eval mode (dropout would make the path integral random).
    """
    if baselines.shape != inputs_embeds.shape:
        raise ValueError(f"baselines {tuple(baselines.shape)} differ from inputs {tuple(inputs_embeds.shape)}")
    planner = alpha_batch_size if isinstance(alpha_batch_size, ChunkPlanner) else ChunkPlanner(alpha_batch_size)
    acc = accumulation_dtype(inputs_embeds)
    inputs, baselines = inputs_embeds.detach().to(acc), baselines.detach().to(acc)
    context = dict(context or {})
    device = inputs.device
    batch = inputs.shape[0]
    tokens = math.prod(inputs.shape[1:-1])
    alphas_np, weights_np = step_rule(method, n_steps)
    alphas = torch.as_tensor(alphas_np, dtype=acc, device=device)
    weights = torch.as_tensor(weights_np, dtype=acc, device=device)
    step = StepPrecision.of(precision, cast_weights)
    module = module_of(forward, model)

    with frozen_parameters(module):
        endpoints = resolve_endpoint_precision(endpoint_precision)
        out_x, out_b = endpoint_outputs(forward, inputs, baselines, attention_mask, context, endpoints)
        target = resolve_target(target, out_x)
        diff = inputs - baselines
        total = torch.zeros(inputs.numel(), dtype=acc, device=device)
        step_context = step.context(context)
        done = 0
        with weights_cast(module, step.weights):
            while done < n_steps:
                steps = planner.next_steps(n_steps - done, batch, tokens, device)
                chunk = _Chunk(baselines, diff, alphas[done : done + steps], attention_mask, step_context, target)
                grads = _attempt(chunk, forward, step, planner, compiler)
                if grads is None:  # retry, once the failed attempt's frames are released
                    free_memory(device)
                    continue
                total.addmv_(grads.to(acc).t(), weights[done : done + steps])
                del grads  # free it before the next chunk allocates its own
                planner.chunk_done(steps, batch, tokens, device)
                done += steps
                if on_chunk is not None:
                    on_chunk(done, n_steps)
    check_finite(total, precision)
    return finish(total.view_as(inputs), inputs, baselines, out_x, out_b, target)


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
    alphas: Tensor  # [steps]
    mask: Tensor | None  # [B, *S]
    context: Mapping[str, Tensor]  # first dim B
    target: Tensor | None  # [B]

    @property
    def steps(self) -> int:
        return self.alphas.numel()

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

    def gradients(self, forward: ForwardFn, step: StepPrecision) -> Tensor:
        """Gradients of the explained output at every point: [steps, B * prod(S) * H] (the step dtype)."""
        steps = self.steps
        scale = self.alphas.view(steps, *([1] * self.baselines.dim()))
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
