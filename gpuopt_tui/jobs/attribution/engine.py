"""Integrated Gradients of one batch of an adapter's data, with the settings of a profile."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.attribution import AttributionSection
from gpuopt_tui.jobs.attention import padded_batch_kernels
from gpuopt_tui.jobs.attribution.adaptive import RULE
from gpuopt_tui.jobs.attribution.baselines import ZERO_ALL, baseline_embeddings, baseline_token_id
from gpuopt_tui.jobs.attribution.chunking import ChunkPlanner
from gpuopt_tui.jobs.attribution.compiled import StepCompiler, should_compile
from gpuopt_tui.jobs.attribution.ig import integrated_gradients
from gpuopt_tui.jobs.attribution.options import IGOptions
from gpuopt_tui.jobs.attribution.precision import REDUCED, output_margins
from gpuopt_tui.jobs.attribution.reference import integrated_gradients_reference
from gpuopt_tui.jobs.attribution.start_precision import PROBE_SAMPLES, PROBE_STEPS, StartPrecision, timer
from gpuopt_tui.jobs.device import amp_dtype_supported, precision
from gpuopt_tui.jobs.models import Adapter, Batch, select_rows

#: Per-sample results of `attribute_batch` (token_scores is [B, *S], the others [B]; see common.IGResult).
RESULT_KEYS = (
    "token_scores",
    "deltas",
    "scores",
    "baseline_scores",
    "target",
    "prediction",
    "probability",
    "margin",
    "low_margin",
    "steps",
    "fallback",
    "error",
    "within",
)
UNRECORDED = ("per_dimension", "endpoint_precision")  # the same in every run (Settings.resolve): not in its summary


@dataclass(frozen=True)
class Settings:
    """What the engine needs from a profile's [attribution] section, resolved for the model and device: the
    integration settings (`ig`) and how the run uses them."""

    ig: IGOptions  # per_dimension off: only token scores are written, so "auto" steps keep no gradients
    target: str  # "predicted", "label" or a class index; "generate" for causal LMs
    baseline: str
    baseline_token: int | None  # the id filling content positions; None for zero vectors
    optimized: bool
    memory_fraction: float
    compile: bool  # torch.compile the forward of the steps

    @classmethod
    def resolve(cls, section: AttributionSection, adapter: Adapter, device: torch.device, samples: int) -> Settings:
        """The settings for a run of `samples` samples on `device` ("auto" compilation depends on its size)."""
        prec = precision(section.use_amp, section.amp_dtype, section.tf32) if device.type == "cuda" else "fp32"
        if not amp_dtype_supported(device, prec):
            prec = "fp16"  # GPUs before Ampere have no bf16
        ig = IGOptions(
            n_steps=section.n_steps,
            method=RULE if section.n_steps == "auto" else section.method,
            tolerance=section.tolerance,
            max_steps=section.max_steps,
            alpha_batch_size=section.alpha_batch_size,  # the chunk size goes through `planner`
            precision=prec,
            cast_weights=section.amp_mode == "weights" and prec in ("bf16", "fp16"),
            full_precision_fallback=section.full_precision_fallback and section.n_steps == "auto",
            per_dimension=False,
        )
        return cls(
            ig=ig,
            target=section.target,
            baseline=section.baseline,
            baseline_token=baseline_token_id(adapter, section.baseline, section.custom_baseline_token),
            optimized=section.use_optimized,
            memory_fraction=section.memory_fraction,
            compile=section.use_optimized and should_compile(section.compile, device, samples, section.n_steps),
        )

    def with_ig(self, **changes: Any) -> Settings:
        """These settings with `changes` to the integration settings."""
        return dataclasses.replace(self, ig=dataclasses.replace(self.ig, **changes))

    def record(self) -> dict[str, object]:
        """The settings as the run's summary writes them, in one flat mapping: the integration settings a run
        chooses (not UNRECORDED: the same for every run), then the others."""
        ig = {k: v for k, v in dataclasses.asdict(self.ig).items() if k not in UNRECORDED}
        return {**ig, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "ig"}}

    def planner(self, on_event: Callable[..., object] | None = None) -> ChunkPlanner:
        return ChunkPlanner(
            self.ig.alpha_batch_size,
            memory_fraction=self.memory_fraction,
            on_event=on_event,
        )

    def start_precision(self, device: torch.device) -> StartPrecision | None:
        """The run's choice of the precision its batches start in (start_precision.py), where there is one."""
        ig = self.ig
        auto = ig.n_steps == "auto" and self.optimized
        return StartPrecision.of(ig.precision, ig.tolerance, auto and ig.full_precision_fallback, device)

    def started_in(self, precision: str) -> Settings:
        """These settings with the steps starting in `precision` (a full one: no cast weights)."""
        return self.with_ig(precision=precision, cast_weights=self.ig.cast_weights and precision in REDUCED)


def step_compiler(
    settings: Settings,
    on_event: Callable[..., object] | None = None,
    on_compiling: Callable[[], None] | None = None,
) -> StepCompiler | None:
    """The run's compiler of the step forward when the settings ask for one (build it once per run: each
    compiler compiles anew); `on_compiling()` is called as each compilation starts."""
    return StepCompiler(on_event=on_event, on_compiling=on_compiling) if settings.compile else None


def batch_target(spec: str, batch: Batch, n_outputs: int) -> Tensor | str:
    """The explained output per sample: "predicted", the dataset labels, or one fixed index."""
    if spec == "predicted":
        return spec
    if spec == "generate":
        raise UserError('attribution.target = "generate" needs a causal language model (model.path of one)')
    if spec == "label":
        if "labels" not in batch:
            raise UserError('attribution.target = "label" but the data has no labels (see data.label_field)')
        return batch["labels"]
    index = int(spec)
    if index >= n_outputs:
        raise UserError(f"attribution.target = {spec}: the model has {n_outputs} outputs (0..{n_outputs - 1})")
    return torch.full((batch["input_ids"].shape[0],), index, dtype=torch.long, device=batch["input_ids"].device)


def attribute_batch(
    adapter: Adapter,
    batch: Batch,
    settings: Settings,
    planner: ChunkPlanner,
    on_chunk: Callable[[int, int], None] | None = None,
    compiler: StepCompiler | None = None,
    target: Tensor | None = None,
    plain: bool = False,
    start: StartPrecision | None = None,
) -> dict[str, Tensor]:
    """IG of one batch already on the adapter's device; per-sample results (RESULT_KEYS) on the CPU.

    `on_chunk(done, total)` reports progress within the batch (steps when batched, (sample, step) pairs
    otherwise);
    `compiler` (see `step_compiler`) compiles the forward of the steps of the batched path;
    `target` [B] explains these outputs instead of the settings' target;
    `plain` runs the batched path on the model's own forward (no lean last layer, no fused attention kernels);
    `start` (see `Settings.start_precision`) chooses whether the steps start in its bf16/fp16 (the settings', or
    bf16 where fp16 overflowed) or in full precision, measuring both on this batch the first time.
    """
    reduced = start is None or start.choose(_probe_timer(adapter, batch, settings, planner))
    if start is not None:  # its reduced precision is bf16 once fp16 overflowed in its probe
        settings = settings.started_in(start.reduced if reduced else start.full)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        embeds = adapter.word_embeddings()(ids)
        context = adapter.encode_context(batch)
    baselines = baseline_embeddings(
        adapter, ids, mask, embeds, settings.baseline_token, keep_structure=settings.baseline != ZERO_ALL
    )
    n_outputs = adapter.num_labels if adapter.input_rank == 1 else ids.shape[1]
    if target is None:
        target = adapter.explained_outputs(settings.target, batch)
    target = batch_target(settings.target, batch, n_outputs) if target is None else target
    forward = adapter.logits_from_embeds
    options, runtime = settings.ig, {"context": context, "model": adapter.model}
    if settings.optimized:
        step_mask = adapter.step_mask(mask)  # None for a batch without padding (one check of the mask, not two)
        lean = contextlib.nullcontext() if plain else adapter.logits_only()
        with lean, padded_batch_kernels(None if plain else step_mask):
            result = integrated_gradients(
                forward,
                embeds,
                baselines,
                step_mask,
                target,
                options,
                planner=planner,
                compiler=compiler,
                on_chunk=on_chunk,
                **runtime,
            )
    else:  # the one-step-at-a-time path stays the model's own forward, for accuracy checks
        result = integrated_gradients_reference(
            forward, embeds, baselines, mask, target, options, on_step=on_chunk, **runtime
        )
    target_index = cast(Tensor, result.target)  # a class index per sample, never None for an adapter
    # F(x) ran in fp32 (see resolve_endpoint_precision): the prediction and the margin are the model's own
    probabilities = result.outputs.float().softmax(-1)
    margin, low_margin = output_margins(result.outputs, options.precision)
    values = {
        "token_scores": result.token_scores().float(),
        "deltas": result.deltas,
        "scores": result.scores,
        "baseline_scores": result.baseline_scores,
        "target": target_index,
        "prediction": result.outputs.argmax(-1),
        "probability": probabilities.gather(1, target_index.unsqueeze(1)).squeeze(1),
        "margin": margin,
        "low_margin": low_margin,
        "steps": result.steps,
        "fallback": result.fallback if start is None else start.observe(reduced, result.fallback),
        # fixed steps have no tolerance: NaN error, never "within" (the results write neither for them)
        "error": result.error if result.error is not None else torch.full_like(result.scores, math.nan),
        "within": result.within if result.within is not None else torch.zeros_like(result.steps, dtype=torch.bool),
    }
    return {k: v.detach().cpu().contiguous() for k, v in values.items()}


def _probe_timer(adapter: Adapter, batch: Batch, settings: Settings, planner: ChunkPlanner) -> Callable[[str], float]:
    """Times PROBE_STEPS fixed steps of the batch's first PROBE_SAMPLES samples in a given precision (built for
    every batch, run only when the run measures)."""

    def run(precision: str) -> None:
        fixed = settings.with_ig(n_steps=PROBE_STEPS, method="gausslegendre", full_precision_fallback=False)
        attribute_batch(adapter, select_rows(batch, slice(0, PROBE_SAMPLES)), fixed.started_in(precision), planner)

    return timer(run, adapter.device)
