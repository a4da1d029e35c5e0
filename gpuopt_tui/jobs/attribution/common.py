"""Pieces shared by the batched and the one-step-at-a-time Integrated Gradients paths."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from gpuopt_tui.jobs.attribution.deltas import relative_deltas
from gpuopt_tui.jobs.device import autocast
from gpuopt_tui.jobs.models.base import tile_rows

#: forward(inputs_embeds [N, *S, H], attention_mask [N, *S] or None, context) -> [N, C] outputs (or [N]
#: scalars when no target is given). `context` holds the tensors that do not depend on the attributed
#: input (first dim N, already tiled to the rows of the call); it is {} when there is none.
ForwardFn = Callable[[Tensor, "Tensor | None", Mapping[str, Tensor]], Tensor]
#: class (or candidate) index per sample [B], "predicted" (argmax of F(x)), or None for scalar outputs.
Target = Tensor | Literal["predicted"] | None


@dataclass
class IGResult:
    """Integrated Gradients of one batch. Float tensors are fp32 (float64 when the inputs are)."""

    attributions: Tensor  # [B, *S, H]: (x - baseline) * integrated gradients; [B, *S, 1] summed per token
    deltas: Tensor  # [B]: sum(attributions) - (F(x) - F(baseline)), signed
    scores: Tensor  # [B]: F(x), the explained output
    baseline_scores: Tensor  # [B]: F(baseline)
    outputs: Tensor  # [B, C] (or [B]): the full forward output at x, e.g. logits
    target: Tensor | None  # [B] long: the explained output index, None for scalar outputs
    steps: Tensor  # [B] long: the interpolation steps each sample used
    fallback: Tensor  # [B] int8: why its steps ran in full precision (precision.FALLBACK_REASONS; 0: they did not)
    error: Tensor | None = None  # [B] "auto" steps: the relative error estimate of its token scores
    within: Tensor | None = None  # [B] bool, "auto" steps: its relative delta and `error` are within the tolerance

    @property
    def full_precision(self) -> Tensor:
        """[B] bool: its steps ran in full precision rather than the run's bf16/fp16."""
        return self.fallback > 0

    def relative_deltas(self) -> Tensor:
        """[B] |delta| / |F(x) - F(baseline)|: the figure attributions.jsonl writes."""
        return relative_deltas(self.deltas, self.scores, self.baseline_scores)

    def token_scores(self) -> Tensor:
        """[B, *S]: attribution per token (sum over the embedding dimension)."""
        return self.attributions.sum(-1)


def accumulation_dtype(inputs: Tensor) -> torch.dtype:
    """fp32, or the input's dtype when it is wider (float64 reference runs)."""
    return torch.promote_types(inputs.dtype, torch.float32)


@contextlib.contextmanager
def frozen_parameters(module: nn.Module | None) -> Iterator[None]:
    """Parameters need no gradient during IG (only the input does); their flags are restored afterwards."""
    params = list(module.parameters()) if module is not None else []
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


def module_of(forward: ForwardFn, model: nn.Module | None) -> nn.Module | None:
    """The module whose parameters to freeze: `model`, else the forward itself or the module it is bound to."""
    if model is not None:
        return model
    owner = getattr(forward, "__self__", forward)
    for candidate in (owner, getattr(owner, "model", None)):  # a module, or an adapter's bound method
        if isinstance(candidate, nn.Module):
            return candidate
    return None


def selected(outputs: Tensor, target: Tensor | None) -> Tensor:
    """The explained output per row [N]: outputs[i, target[i]], or the outputs themselves for scalars."""
    if target is None:
        if outputs.dim() != 1:
            raise ValueError(f"without a target the forward must return one scalar per row, got {outputs.shape}")
        return outputs
    return outputs.reshape(outputs.shape[0], -1).gather(1, target.unsqueeze(1)).squeeze(1)


def resolve_endpoint_precision(override: str | None = None) -> str:
    """Precision of the F(x), F(baseline) forward: never autocast, and by default strict fp32 whatever the
    steps run in, so that the explained class (argmax of F(x)) and the convergence deltas do not carry the
    steps' rounding (a bf16 forward can swap two classes whose logits differ by less than its error). On the GPU
    "tf32" trades that for speed (about 1e-3 relative on the outputs)."""
    if override is not None:
        if override not in ("fp32", "tf32"):
            raise ValueError(f'endpoint_precision must be "fp32" or "tf32", got {override!r}')
        return override
    return "fp32"


def endpoint_outputs(
    forward: ForwardFn,
    inputs: Tensor,
    baselines: Tensor,
    mask: Tensor | None,
    context: Mapping[str, Tensor],
    precision: str,
) -> tuple[Tensor, Tensor]:
    """Forward outputs at x and at the baseline (one call of 2B rows, no gradient) in `precision`."""
    batch = inputs.shape[0]
    with torch.no_grad(), autocast(inputs.device, precision):
        out = forward(
            torch.cat([inputs, baselines]),
            None if mask is None else tile_rows(mask, 2),
            tile_rows(context, 2),
        )
    out = out.to(accumulation_dtype(inputs))
    return out[:batch], out[batch:]


def resolve_target(target: Target, outputs: Tensor) -> Tensor | None:
    if isinstance(target, str):
        if target != "predicted":
            raise ValueError(f'target must be a tensor, "predicted" or None, got {target!r}')
        return outputs.reshape(outputs.shape[0], -1).argmax(-1)
    return None if target is None else target.to(device=outputs.device, dtype=torch.long)


def path_attributions(integrated_grads: Tensor, inputs: Tensor, baselines: Tensor) -> Tensor:
    """(x - baseline) * integrated gradients, in the gradients' dtype (fp32 or wider)."""
    dtype = integrated_grads.dtype
    return (inputs.to(dtype) - baselines.to(dtype)) * integrated_grads


@dataclass(frozen=True)
class Verdict:
    """What "auto" steps judge a sample by, besides its delta: its token scores' relative error estimate [B], and
    the tolerance both are held to."""

    error: Tensor
    tolerance: float


def finish(
    attributions: Tensor,
    out_x: Tensor,
    out_b: Tensor,
    target: Tensor | None,
    steps: Tensor,
    fallback: Tensor | None = None,
    verdict: Verdict | None = None,
) -> IGResult:
    """The result with its convergence deltas and, with a `verdict`, whether each sample is within its tolerance:
    the one place that decides it, from the very relative delta the results write. `fallback` (none: no sample)
    says why a sample's steps ran in full precision."""
    scores, base_scores = selected(out_x, target), selected(out_b, target)
    deltas = attributions.reshape(attributions.shape[0], -1).sum(1) - (scores - base_scores)
    if fallback is None:
        fallback = torch.zeros_like(steps, dtype=torch.int8)
    result = IGResult(attributions, deltas, scores, base_scores, out_x, target, steps, fallback)
    if verdict is not None:
        result.error = verdict.error
        # compared in float64: a figure equal to fp32(tolerance) may exceed the tolerance itself
        tolerance = verdict.tolerance
        result.within = (result.relative_deltas().double() <= tolerance) & (verdict.error.double() <= tolerance)
    return result
