"""Batched Integrated Gradients: all samples of a batch x a chunk of interpolation steps per pass."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from gpuopt_tui.jobs.attribution.adaptive import REDUCED_CAP, needs_full_precision, precision_chain
from gpuopt_tui.jobs.attribution.chunking import ChunkPlanner
from gpuopt_tui.jobs.attribution.common import (
    ForwardFn,
    IGResult,
    Target,
    Verdict,
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
from gpuopt_tui.jobs.attribution.passes import Passes, Rows
from gpuopt_tui.jobs.attribution.precision import REDUCED, StepPrecision, check_finite
from gpuopt_tui.jobs.attribution.refine import Level, Limits, Refinement
from gpuopt_tui.jobs.attribution.rules import step_rule

OUTPUT_CHANGE = 1  # index in precision.FALLBACK_REASONS: routed to full precision before its first pass


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
    delta and the relative error estimate of its token scores are within `tolerance`, or one more pass would take
    it over `max_steps` (see adaptive.py; `method` is not used); each refinement pass runs the unconverged samples
    only, each at its own new points. The result's `within` says, per sample, whether both figures it carries
    (`relative_deltas`, `error`) are within the tolerance. With `full_precision_fallback`, a sample moves along
    adaptive.precision_chain (bf16/fp16 -> TF32 -> fp32): from bf16/fp16 when its output moves too little for
    them, or when it has not settled within adaptive.REDUCED_CAP points; from any precision but fp32 when the
    rounding measured on its first pass against the next precision would take half its tolerance; the result's
    `fallback` says why (precision.FALLBACK_REASONS).
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
        rows = Rows(baselines, inputs - baselines, inputs.new_zeros(0), attention_mask, dict(context or {}), target)
        if n_steps == "auto":
            fallback = full_precision_fallback and len(precision_chain(precision, tolerance)) > 1
            auto = _AutoSteps(forward, planner, compiler, on_chunk, tolerance, max_steps, per_dimension)
            total, steps, error, reason = auto.run(module, rows, (out_x, out_b), step, precision, fallback)
        else:
            passes = Passes(forward, step, planner, compiler, on_chunk, module)
            alphas, weights = (torch.as_tensor(v, dtype=acc, device=inputs.device) for v in step_rule(method, n_steps))
            total = passes.integrate(rows, alphas, weights)
            steps = torch.full((batch,), n_steps, dtype=torch.long, device=inputs.device)
            error, reason = None, torch.zeros(batch, dtype=torch.int8, device=inputs.device)
    check_finite(total, precision)
    if n_steps == "auto" and not per_dimension:
        attributions = total.view(*inputs.shape[:-1], 1)
    else:
        attributions = path_attributions(total.view_as(inputs), inputs, baselines)
        attributions = attributions if per_dimension else attributions.sum(-1, keepdim=True)
    verdict = None if error is None else Verdict(error, tolerance)
    return finish(attributions, out_x, out_b, target, steps, reason, verdict)


@dataclass
class _AutoSteps:
    """`n_steps = "auto"` over a batch: each sample refined in its precision (adaptive.py), the samples that
    cannot settle in bf16/fp16 again in full precision."""

    forward: ForwardFn
    planner: ChunkPlanner
    compiler: StepCompiler | None
    on_chunk: Callable[[int, int], None] | None
    tolerance: float
    max_steps: int
    per_dimension: bool

    def run(
        self,
        module: nn.Module | None,
        rows: Rows,
        ends: tuple[Tensor, Tensor],
        step: StepPrecision,
        precision: str,
        fallback: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Integrated gradients (or token scores), points, relative error estimates and fallback reasons (index in
        precision.FALLBACK_REASONS) per sample."""
        batch, device = rows.rows, rows.diff.device
        explained = selected(ends[0], rows.target), selected(ends[1], rows.target)
        width = rows.diff[0].numel() if self.per_dimension else rows.tokens
        total = rows.diff.new_zeros(batch, width)
        steps = torch.zeros(batch, dtype=torch.long, device=device)
        error = rows.diff.new_zeros(batch)
        reason = torch.zeros(batch, dtype=torch.int8, device=device)
        chain = precision_chain(precision, self.tolerance) if fallback else [precision]
        level = torch.zeros(batch, dtype=torch.long, device=device)
        if len(chain) > 1 and precision in REDUCED:
            routed = needs_full_precision(*explained, self.tolerance, precision, rows.diff.dtype)
            level[routed], reason[routed] = 1, OUTPUT_CHANGE
        for k, name in enumerate(chain):
            members = (level == k).nonzero().squeeze(1)
            if not len(members):
                continue
            here = step if k == 0 else StepPrecision.of(name)
            probe = StepPrecision.of(chain[k + 1]) if k + 1 < len(chain) else None
            cap = min(REDUCED_CAP, self.max_steps) if probe is not None and name in REDUCED else None
            ends_here = (explained[0][members], explained[1][members])
            got = self._level(module, rows.select(members), ends_here, here, probe, cap, (k, len(chain)))
            total[members], steps[members], error[members] = got.total, got.steps, got.error
            moved = got.escalate > 0
            level[members[moved]], reason[members[moved]] = k + 1, got.escalate[moved]
        return total, steps, error, reason

    def _level(
        self,
        module: nn.Module | None,
        rows: Rows,
        ends: tuple[Tensor, Tensor],
        step: StepPrecision,
        probe: StepPrecision | None,
        cap: int | None,
        share: tuple[int, int],
    ) -> Level:
        """The samples of `rows` refined in `step`'s precision; with a `probe` (the next precision of the chain)
        the samples that should run in it instead, after their first pass or at `cap` points, are handed back
        (`Level.escalate`). The compiled graph is the first level's."""
        compiler = self.compiler if share[0] == 0 else None
        passes = Passes(self.forward, step, self.planner, compiler, self.on_chunk, module)
        probing = None if probe is None else Passes(self.forward, probe, self.planner, None, None, module)
        limits = Limits(self.tolerance, self.max_steps, cap)
        return Refinement(passes, rows, ends, limits, self.per_dimension, probing).run(share)
