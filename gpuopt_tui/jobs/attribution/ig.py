"""Batched Integrated Gradients: all samples of a batch x a chunk of interpolation steps per pass."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

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
from gpuopt_tui.jobs.attribution.options import DEFAULT_OPTIONS, IGOptions
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
    options: IGOptions = DEFAULT_OPTIONS,
    *,
    planner: ChunkPlanner | None = None,
    compiler: StepCompiler | None = None,
    context: Mapping[str, Tensor] | None = None,
    model: nn.Module | None = None,
    on_chunk: Callable[[int, int], None] | None = None,
) -> IGResult:
    """Integrated Gradients of `forward` with respect to `inputs_embeds` [B, *S, H], integrated as `options` say
    (options.py documents each setting).

    forward (callable):
        forward(embeds, attention_mask, **context) -> outputs [rows, n_outputs] (or [rows] without a target).
    inputs_embeds (Tensor [B, *S, H]) and baselines (Tensor, same shape):
        The two ends of the path; attributions are taken with respect to the inputs.
    attention_mask (Tensor or None, default None):
        Handed to the forward, tiled to the rows of each chunk.
    target (Tensor [B], "predicted" or None, default "predicted"):
        The explained output per sample; "predicted" is the argmax of F(x); None for a scalar forward.
    planner (ChunkPlanner or None, default None):
        A chunk planner shared across calls (what it learnt of the memory carries over); None builds one from
        `options.alpha_batch_size`.
    compiler (StepCompiler or None, default None):
        torch.compile's the step forward (compiled.py).
    context (mapping of Tensor or None, default None):
        Tensors of first dimension B, tiled to the rows of each chunk and handed to the forward.
    model (nn.Module or None, default None):
        Whose parameters are frozen during the call (by default the forward's own module).
    on_chunk (callable or None, default None):
        on_chunk(done, total), called after every chunk (e.g. to check for cancellation).

    Interpolated points are laid out step-major (row k*B+i is step k of sample i) and processed in chunks of
    whole steps for all samples. Gradients come from `torch.autograd.grad` with respect to the interpolated
    embeddings only and are weighted and summed in fp32. With "auto" steps each refinement pass runs the
    unconverged samples only, each at its own new points; the result's `within` says, per sample, whether both
    figures it carries (`relative_deltas`, `error`) are within the tolerance, and `fallback` why a sample moved
    to a fuller precision (precision.FALLBACK_REASONS). With fixed steps every gradient of a batch is kept until
    it is summed. The model should be in eval mode (dropout would make the path integral random).
    """
    if baselines.shape != inputs_embeds.shape:
        raise ValueError(f"baselines {tuple(baselines.shape)} differ from inputs {tuple(inputs_embeds.shape)}")
    planner = ChunkPlanner(options.alpha_batch_size) if planner is None else planner
    acc = accumulation_dtype(inputs_embeds)
    inputs, baselines = inputs_embeds.detach().to(acc), baselines.detach().to(acc)
    batch = inputs.shape[0]
    step = StepPrecision.of(options.precision, options.cast_weights)
    module = module_of(forward, model)

    with frozen_parameters(module):
        endpoints = resolve_endpoint_precision(options.endpoint_precision)
        out_x, out_b = endpoint_outputs(forward, inputs, baselines, attention_mask, dict(context or {}), endpoints)
        target = resolve_target(target, out_x)
        rows = Rows(baselines, inputs - baselines, inputs.new_zeros(0), attention_mask, dict(context or {}), target)
        if options.n_steps == "auto":
            auto = _AutoSteps(forward, planner, compiler, on_chunk, options)
            total, steps, error, reason = auto.run(module, rows, (out_x, out_b), step)
        else:
            passes = Passes(forward, step, planner, compiler, on_chunk, module)
            alphas, weights = (
                torch.as_tensor(v, dtype=acc, device=inputs.device) for v in step_rule(options.method, options.n_steps)
            )
            total = passes.integrate(rows, alphas, weights)
            steps = torch.full((batch,), options.n_steps, dtype=torch.long, device=inputs.device)
            error, reason = None, torch.zeros(batch, dtype=torch.int8, device=inputs.device)
    check_finite(total, options.precision)
    if options.n_steps == "auto" and not options.per_dimension:
        attributions = total.view(*inputs.shape[:-1], 1)
    else:
        attributions = path_attributions(total.view_as(inputs), inputs, baselines)
        attributions = attributions if options.per_dimension else attributions.sum(-1, keepdim=True)
    verdict = None if error is None else Verdict(error, options.tolerance)
    return finish(attributions, out_x, out_b, target, steps, reason, verdict)


@dataclass
class _AutoSteps:
    """`n_steps = "auto"` over a batch: each sample refined in its precision (adaptive.py), the samples that
    cannot settle in bf16/fp16 again in full precision."""

    forward: ForwardFn
    planner: ChunkPlanner
    compiler: StepCompiler | None
    on_chunk: Callable[[int, int], None] | None
    options: IGOptions

    def run(
        self,
        module: nn.Module | None,
        rows: Rows,
        ends: tuple[Tensor, Tensor],
        step: StepPrecision,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Integrated gradients (or token scores), points, relative error estimates and fallback reasons (index in
        precision.FALLBACK_REASONS) per sample."""
        batch, device = rows.rows, rows.diff.device
        explained = selected(ends[0], rows.target), selected(ends[1], rows.target)
        options = self.options
        width = rows.diff[0].numel() if options.per_dimension else rows.tokens
        total = rows.diff.new_zeros(batch, width)
        steps = torch.zeros(batch, dtype=torch.long, device=device)
        error = rows.diff.new_zeros(batch)
        reason = torch.zeros(batch, dtype=torch.int8, device=device)
        chain = precision_chain(options.precision, options.tolerance) if options.full_precision_fallback else []
        chain = chain if len(chain) > 1 else [options.precision]
        level = torch.zeros(batch, dtype=torch.long, device=device)
        if len(chain) > 1 and options.precision in REDUCED:
            routed = needs_full_precision(*explained, options.tolerance, options.precision, rows.diff.dtype)
            level[routed], reason[routed] = 1, OUTPUT_CHANGE
        for k, name in enumerate(chain):
            members = (level == k).nonzero().squeeze(1)
            if not len(members):
                continue
            here = step if k == 0 else StepPrecision.of(name)
            probe = StepPrecision.of(chain[k + 1]) if k + 1 < len(chain) else None
            cap = min(REDUCED_CAP, options.max_steps) if probe is not None and name in REDUCED else None
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
        limits = Limits(self.options.tolerance, self.options.max_steps, cap)
        return Refinement(passes, rows, ends, limits, self.options.per_dimension, probing).run(share)
