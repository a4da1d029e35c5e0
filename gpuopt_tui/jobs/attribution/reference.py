"""The one-sample, one-step-at-a-time Integrated Gradients loop: the accuracy reference and the CPU path."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

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
from gpuopt_tui.jobs.attribution.options import DEFAULT_OPTIONS, IGOptions
from gpuopt_tui.jobs.attribution.precision import StepPrecision, check_finite, weights_cast
from gpuopt_tui.jobs.attribution.rules import step_rule
from gpuopt_tui.jobs.device import autocast


def integrated_gradients_reference(
    forward: ForwardFn,
    inputs_embeds: Tensor,
    baselines: Tensor,
    attention_mask: Tensor | None = None,
    target: Target = "predicted",
    options: IGOptions = DEFAULT_OPTIONS,
    *,
    context: Mapping[str, Tensor] | None = None,
    model: nn.Module | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> IGResult:
    """Same contract as `integrated_gradients` (without compilation), computed with one forward/backward per
    (sample, step). Of `options` it takes the steps (an integer), the rule and the precisions; the attributions are
    always per embedding dimension.

    `on_step(done, total)` is called after every (sample, step) pair: done of n_samples x n_steps.
    """
    if baselines.shape != inputs_embeds.shape:
        raise ValueError(f"baselines {tuple(baselines.shape)} differ from inputs {tuple(inputs_embeds.shape)}")
    acc = accumulation_dtype(inputs_embeds)
    inputs, baselines = inputs_embeds.detach().to(acc), baselines.detach().to(acc)
    context = dict(context or {})
    alphas, weights = step_rule(options.method, options.n_steps)
    batch = inputs.shape[0]
    step = StepPrecision.of(options.precision, options.cast_weights)
    module = module_of(forward, model)
    with frozen_parameters(module):
        endpoints = resolve_endpoint_precision(options.endpoint_precision)
        out_x, out_b = endpoint_outputs(forward, inputs, baselines, attention_mask, context, endpoints)
        target = resolve_target(target, out_x)
        grads = torch.zeros_like(inputs)
        step_context = step.context(context)
        with weights_cast(module, step.weights):
            for i in range(batch):
                one = slice(i, i + 1)
                mask = None if attention_mask is None else attention_mask[one]
                sample_context = {k: v[one] for k, v in step_context.items()}
                sample_target = None if target is None else target[one]
                for j, (alpha, weight) in enumerate(zip(alphas.tolist(), weights.tolist())):
                    point = step.inputs(baselines[one] + alpha * (inputs[one] - baselines[one])).requires_grad_()
                    grad = _gradient(forward, point, mask, sample_context, sample_target, step.autocast, acc)
                    grads[i] += weight * grad[0].to(acc)
                    if on_step is not None:
                        on_step(i * len(alphas) + j + 1, batch * len(alphas))
    check_finite(grads, options.precision)
    steps = torch.full((batch,), int(options.n_steps), dtype=torch.long, device=inputs.device)
    return finish(path_attributions(grads, inputs, baselines), out_x, out_b, target, steps)


def _gradient(
    forward: ForwardFn,
    point: Tensor,
    mask: Tensor | None,
    context: Mapping[str, Tensor],
    target: Tensor | None,
    precision: str,
    acc: torch.dtype,
) -> Tensor:
    """The gradient of the target outputs at one interpolation point (the forward in `precision`)."""
    with torch.enable_grad():
        with autocast(point.device, precision):
            out = forward(point, mask, context)
        (grad,) = torch.autograd.grad(selected(out.to(acc), target).sum(), point)
    return grad
