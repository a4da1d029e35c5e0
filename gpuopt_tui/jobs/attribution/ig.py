"""Batched Integrated Gradients: all samples of a batch x a chunk of interpolation steps per pass."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
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
    endpoint_precision: str | None = None,
    context: Mapping[str, Tensor] | None = None,
    model: nn.Module | None = None,
    on_chunk: Callable[[int, int], None] | None = None,
) -> IGResult:
    """Integrated Gradients of `forward` with respect to `inputs_embeds` [B, *S, H].

    Interpolated points are laid out step-major (row k*B+i is step k of sample i) and processed in chunks of
    whole steps for all samples (`alpha_batch_size` steps, "auto" to fit the GPU memory, None for all at
    once, or a shared `ChunkPlanner`); a chunk that runs out of GPU memory is halved and retried. The
    forward runs under `precision` ("fp32", "tf32", "bf16", "fp16" autocast); gradients come from
    `torch.autograd.grad` with respect to the interpolated embeddings only (the parameters of `model`, by
    default the forward's own module, are frozen meanwhile) and are weighted and summed in fp32.
    F(x) and F(baseline) (and so the convergence deltas) are never autocast: `endpoint_precision` "fp32", or
    by default "tf32" (TF32 matmuls on the GPU) when the steps run in reduced precision.
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

    with frozen_parameters(module_of(forward, model)):
        endpoints = resolve_endpoint_precision(precision, endpoint_precision)
        out_x, out_b = endpoint_outputs(forward, inputs, baselines, attention_mask, context, endpoints)
        target = resolve_target(target, out_x)
        diff = inputs - baselines
        total = torch.zeros(inputs.numel(), dtype=acc, device=device)
        done = 0
        while done < n_steps:
            steps = planner.next_steps(n_steps - done, batch, tokens, device)
            try:
                grads = _chunk_gradients(
                    forward, baselines, diff, alphas[done : done + steps], attention_mask, context, target, precision
                )
            except Exception as exc:
                if not is_oom(exc) or not planner.shrink(steps, batch, tokens):
                    raise
                grads = None
            if grads is None:  # out of memory: retry outside the handler, once its frames are released
                free_memory(device)
                continue
            total.addmv_(grads.t(), weights[done : done + steps])
            del grads  # free it before the next chunk allocates its own
            planner.chunk_done(steps, batch, tokens, device)
            done += steps
            if on_chunk is not None:
                on_chunk(done, n_steps)
    return finish(total.view_as(inputs), inputs, baselines, out_x, out_b, target)


def _chunk_gradients(
    forward: ForwardFn,
    baselines: Tensor,
    diff: Tensor,
    alphas: Tensor,
    mask: Tensor | None,
    context: Mapping[str, Tensor],
    target: Tensor | None,
    precision: str,
) -> Tensor:
    """Gradients of the explained output at `len(alphas)` steps for every sample: [steps, B * prod(S) * H]."""
    steps = alphas.numel()
    batch = baselines.shape[0]
    scale = alphas.view(steps, *([1] * baselines.dim()))
    points = torch.addcmul(baselines.unsqueeze(0), scale, diff.unsqueeze(0))
    points = points.view(steps * batch, *baselines.shape[1:]).requires_grad_()
    with torch.enable_grad():
        with autocast(baselines.device, precision):
            out = forward(points, None if mask is None else tile_rows(mask, steps), tile_rows(context, steps))
        rows_target = None if target is None else tile_rows(target, steps)
        chosen = selected(out.to(baselines.dtype), rows_target)
        (grads,) = torch.autograd.grad(chosen.sum(), points)
    return grads.reshape(steps, -1)
