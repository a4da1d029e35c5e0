"""One planning session, from a plan profile to previewed config edits: what the CLI and the planner screen call.

inputs = prepare(profile)                      # model, training setup, GPU budget, config, stages
current = estimate_current(inputs)             # breakdown of the config as it is
traced = trace_current(inputs)                 # the same step traced on fake tensors (any family, seconds)
rec = recommend_closed_form(inputs)            # or: plan = measure_probes(inputs); rec = recommend_measured(...)
rec, plan = recommend_preferred(inputs)        # measured when this machine has the planned-for GPU, else estimated
patches = planned_patches(inputs, rec)         # previews with diffs; apply.apply(patches) writes them

The closed-form search keeps `search.CLOSED_FORM_HEADROOM` of the budget back for the estimate's error; a measured
recommendation is confirmed by a probe at its batch and keeps back the drift its probes measured (its `headroom`).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuopt_tui.core.demo_architectures import DEMO_ARCHITECTURES, DEMO_TASKS
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.paths import cache_dir
from gpuopt_tui.core.planner import gpu as gpu_memory
from gpuopt_tui.core.planner import modelfind, trainconfig
from gpuopt_tui.core.planner.estimate import Estimate, Overheads, estimate
from gpuopt_tui.core.planner.fit import ProbeResult
from gpuopt_tui.core.planner.measure import MeasuredPlan, confirm_choice, measure, probe_request, run_probe
from gpuopt_tui.core.planner.model_spec import (
    SUPPORTED,
    TASKS,
    ModelSpec,
    load_config,
    named_task,
    spec_from_config,
)
from gpuopt_tui.core.planner.resolve import CONFIG, DEFAULT, PROFILE, Origins, Resolved, resolve_setup_roles, warnings
from gpuopt_tui.core.planner.search import (
    CLOSED_FORM_HEADROOM,
    Budget,
    PeakModel,
    Recommendation,
    Stage,
    accumulate_for,
    closed_form,
    largest_batch,
    recommend,
)
from gpuopt_tui.core.planner.traced import TRACED, TRACED_HEADROOM, TracedEstimate, run_trace, traced_estimate
from gpuopt_tui.core.planner.train_setup import TrainSetup
from gpuopt_tui.core.planner.yamledit import FilePatch, Scalar, ValueEdit
from gpuopt_tui.core.profiles.common import ModelSection
from gpuopt_tui.core.profiles.plan import PlanProfile

DEFAULT_SEQ_LEN = 128
# The planner's defaults, for values set nowhere (a warning says so for the memory-relevant ones)
DEFAULTS: dict[str, Any] = {
    "micro_batch": 8,
    "accumulate": 1,
    "precision": "bf16-mixed",
    "trainable": "all",
    "lora_rank": 8,
    "gradient_checkpointing": False,
    "n_gpus": 1,
    "zero_stage": 0,
    "n_positives": 0,
    "n_negatives": 0,
    "loop": "lightning",  # the most memory: it keeps the previous gradients through the forward pass
}
# LoRA's usual targets per architecture: the attention query and value projections
LORA_TARGETS = {"bert": ("query", "value"), "roberta": ("query", "value"), "distilbert": ("q_lin", "v_lin")}
LORA_TARGETS_DECODER = ("q_proj", "v_proj")
LORA_TARGETS_GPT2 = ("c_attn",)
LORA_TARGETS_OTHER = ("all-linear",)  # families the closed form does not cover: their linear layers' names vary


@dataclass(frozen=True)
class ModelSource:
    config: dict[str, Any]  # the Hugging Face config mapping
    label: str
    task: str = "auto"  # a task the source implies (the demos: a classifier and an embedding model)


@dataclass(frozen=True)
class StageFile:
    stage: Stage
    config: trainconfig.TrainingConfig


@dataclass(frozen=True)
class PlanInputs:
    profile: PlanProfile
    model: ModelSource
    spec: ModelSpec | None  # None where the closed form does not cover the model's family (`refusal` says so)
    setup: TrainSetup  # the training step as the config (and the profile's explicit values) describe it
    gpu: gpu_memory.GpuMemory
    budget: Budget
    config: trainconfig.TrainingConfig | None
    stages: tuple[StageFile, ...]
    target: int  # effective batch to keep
    notes: tuple[str, ...]
    values: tuple[Resolved, ...] = ()  # the model and every setup value, each with its source
    warnings: tuple[str, ...] = ()  # memory-relevant values that only a default sets
    layout: str = ""  # the training config's framework layout, as detected
    task: str = "classification"  # the head that trains (the spec's task where there is a spec)
    refusal: str = ""  # why the closed form has no estimate of this model (its family is not one it covers)

    def closed_form_spec(self) -> ModelSpec:
        """The closed form's model description; UserError (pointing at the traced tier) where it has none."""
        if self.spec is None:
            where = "plan --show --trace, or Trace on the planner screen"
            raise UserError(f"{self.refusal}; the traced tier covers it: {where}")
        return self.spec


def model_source(model: ModelSection) -> ModelSource:
    """The model config to plan for: a local model directory or config.json, or a demo model's config."""
    if model.adapter == "hf":
        config, label = load_config(model.path)
        return ModelSource(config, label)
    if model.adapter == "demo":
        return ModelSource(demo_config(model.demo), f"demo {model.demo}", DEMO_TASKS[model.demo])
    raise UserError(
        f"model adapter = plugin ({model.factory}): the planner reads architectures from a Hugging Face config; "
        "give --model DIR (a directory with the model's config.json) or model.path"
    )


def demo_config(kind: str) -> dict[str, Any]:
    """A demo model's config: that of its newest built cache, else its sizes as the demo code builds them."""
    versions = {}
    for path in (cache_dir() / "demo").glob(f"{kind}-v*/model/config.json"):
        match = re.fullmatch(rf"{re.escape(kind)}-v(\d+)", path.parent.parent.name)  # not the -seedN variants
        if match:
            versions[int(match.group(1))] = path
    return load_config(versions[max(versions)])[0] if versions else copy.deepcopy(DEMO_ARCHITECTURES[kind])


def device_index(device: str) -> int:
    """The CUDA index of a run.device value (auto and cuda mean GPU 0)."""
    return int(device[5:]) if device.startswith("cuda:") else 0


def measuring_gpu(device: str) -> gpu_memory.GpuMemory:
    """The GPU that probes for run.device would run on; UserError when measuring cannot happen here."""
    if device == "cpu":
        raise UserError("measuring runs probes on a GPU and run.device = cpu: set it to auto, cuda or cuda:N")
    index = device_index(device)
    found = gpu_memory.detect(index)
    if found is None:
        raise UserError(f"No GPU {index} found here through NVML: measuring needs a GPU")
    return found


def prepare(
    profile: PlanProfile, gpu: gpu_memory.GpuMemory | None = None, origins: Origins | None = None
) -> PlanInputs:
    """Everything a plan needs, read and checked: UserError for any problem the user can fix. `gpu` replaces
    the profile's GPU memory (gpu_memory_gb, or NVML detection). Every value is resolved once, command line >
    training config > profile > default (`origins` says which values the command line set; without it the
    profile's values are the profile's)."""
    p = profile.plan
    origins = origins or Origins(profile=f"profile {profile.name}")
    config = None
    notes: list[str] = []
    if p.config:
        config = trainconfig.read(Path(p.config).expanduser(), trainconfig.parse_keys(p.keys), p.overrides)
        notes += [
            f"{s.where}: {s.file_key} = {s.value!r} is not a value the planner models for {role}; ignored"
            for role, s in config.unread.items()
        ]
    source, model = model_source_resolved(profile, config, origins)
    task = p.task if p.task != "auto" else source.task
    spec, refusal = _closed_form_spec(source, task)
    guessed = [] if task != "auto" or named_task(source.config) or spec is None else [_guessed_task(spec)]
    task = spec.task if spec is not None else _traced_task(source, task)
    resolved = resolve_setup_roles(p, config, origins, partial_default(spec, source.config))
    values = {name: r.value for name, r in resolved.items()}
    setup = TrainSetup(optimizer=p.optimizer, **values)
    notes += [f"{r.label} {r.text} ({r.source}): {r.note}" for r in resolved.values() if r.note]
    rope = ("llama", "mistral", "qwen2", "qwen3")  # rotary positions: no table of positions to run out of
    if spec is not None and setup.seq_len > spec.max_positions and spec.model_type not in rope:
        notes.append(f"sequence length {setup.seq_len} exceeds the model's {spec.max_positions} positions")
    setup.check()
    if spec is not None and setup.trainable == "lora":
        try:
            spec.lora_linears(setup.lora_targets)
        except UserError as e:
            raise UserError(f"{e} (LoRA targets from {resolved['lora_targets'].source})") from None
    stages = tuple(_stage(Path(s).expanduser(), p.keys) for s in p.stages)
    memory = gpu or gpu_memory.resolve(
        None if p.gpu_memory_gb == "auto" else float(p.gpu_memory_gb), device_index(profile.run.device)
    )
    every = (model, *(r for r in resolved.values() if _shown(r, setup)))
    return PlanInputs(
        profile=profile,
        model=source,
        spec=spec,
        setup=setup,
        gpu=memory,
        budget=Budget(memory.total, p.margin),
        config=config,
        stages=stages,
        target=p.effective_batch or setup.effective_batch,
        notes=tuple(notes),
        values=every,
        warnings=tuple(model_warning(model) + guessed + warnings(resolved)),
        layout=config.layout.label if config is not None else "",
        task=task,
        refusal=refusal,
    )


def _closed_form_spec(source: ModelSource, task: str) -> tuple[ModelSpec | None, str]:
    """The closed form's spec of the model, or None and why where its family is not one the closed form covers
    (every other problem with the config is an error)."""
    try:
        return spec_from_config(source.config, source.label, task), ""
    except UserError as e:
        if str(source.config.get("model_type", "")) in SUPPORTED or not source.config.get("model_type"):
            raise
        return None, str(e)


def _traced_task(source: ModelSource, task: str) -> str:
    """The head to trace for a model the closed form does not cover: the profile's, else the config's."""
    if task != "auto":
        if task not in TASKS:
            raise UserError(f'task "{task}": expected auto or one of {", ".join(TASKS)}')
        return task
    named = named_task(source.config)
    if named is None:
        raise UserError(
            f"{source.label}: its config names no architecture the planner knows; say which head trains with "
            f"plan.task (--task): {', '.join(TASKS)}"
        )
    return named


def _guessed_task(spec: ModelSpec) -> str:
    return (
        f"the model's config.json names no architecture: planning for {spec.task.replace('_', ' ')}, the usual head "
        f"of {spec.model_type} models (plan.task, or --set plan.task=..., says which head trains: classification, "
        "masked_lm, causal_lm or embedding)"
    )


def _shown(r: Resolved, setup: TrainSetup) -> bool:
    """LoRA's values only when LoRA trains; samples per anchor only when something sets them."""
    if r.role in ("lora_rank", "lora_targets"):
        return setup.trainable == "lora"
    return r.role not in ("n_positives", "n_negatives") or r.origin != DEFAULT


def partial_default(spec: ModelSpec | None, config: Mapping[str, Any] | None = None) -> Callable[[str], Any]:
    """The planner's default of a setup value for this model (from its config where the closed form has no spec:
    LoRA then targets every linear layer)."""

    def default(name: str) -> Any:
        if name == "seq_len":
            positions = spec.max_positions if spec is not None else _positions(config or {})
            return min(DEFAULT_SEQ_LEN, positions)
        if name == "lora_targets":
            if spec is None:
                return LORA_TARGETS_OTHER
            if spec.model_type == "gpt2":
                return LORA_TARGETS_GPT2
            return LORA_TARGETS.get(spec.model_type, LORA_TARGETS_DECODER)
        return DEFAULTS[name]

    return default


def _positions(config: Mapping[str, Any]) -> int:
    for key in ("max_position_embeddings", "n_positions"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return DEFAULT_SEQ_LEN


def model_source_resolved(
    profile: PlanProfile, config: trainconfig.TrainingConfig | None, origins: Origins
) -> tuple[ModelSource, Resolved]:
    """The model to plan for: --model, else the one the config names (found locally, or UserError: never the demo
    model instead), else the profile's."""
    name, setting = config.typed("model") if config is not None else (None, None)
    flag = origins.flags.get("model")
    if flag:
        source = model_source(profile.model)
        lost = (f"{name} ({setting.where})",) if setting is not None else ()
        return source, Resolved("model", "model", source.label, flag, "command line", lost)
    if setting is not None:
        bases = list(dict.fromkeys([setting.path.parent.resolve(), Path.cwd()]))
        found = modelfind.require(name, bases, f"{setting.where}: {setting.file_key}")
        config_json, _ = load_config(found)
        overridden = () if profile.model.adapter == "demo" else (f"{_profile_model(profile)} ({origins.profile})",)
        label = name if str(found.parent) == name else f"{name} ({found.parent})"
        return ModelSource(config_json, label), Resolved("model", "model", label, setting.where, CONFIG, overridden)
    source = model_source(profile.model)
    origin = PROFILE if origins.profile else DEFAULT
    return source, Resolved("model", "model", source.label, origins.profile or "default", origin)


def _profile_model(profile: PlanProfile) -> str:
    m = profile.model
    return m.path if m.adapter == "hf" else m.factory


def model_warning(model: Resolved) -> list[str]:
    if model.origin in (CONFIG, "command line") or not model.value.startswith("demo "):
        return []
    return [
        f"planning the {model.value} model ({model.source}): the config names no model; name it there "
        "(e.g. model_name_or_path) or give --model DIR"
    ]


def _stage(path: Path, keys: list[str]) -> StageFile:
    config = trainconfig.read(path, trainconfig.parse_keys(keys))
    counts = []
    for role in ("n_positives", "n_negatives"):
        config.require(role)  # a stage file must set both
        counts.append(config.typed(role)[0])
    return StageFile(Stage(str(path), *counts), config)


def estimate_current(inputs: PlanInputs) -> Estimate:
    """The closed-form breakdown of the training step as configured now."""
    return estimate(inputs.closed_form_spec(), inputs.setup)


def trace_current(inputs: PlanInputs, log: Callable[[str], None] = lambda message: None) -> TracedEstimate:
    """The traced tier's breakdown of the training step as configured now (seconds: a child process traces it,
    telling `log` what it is doing)."""
    request = probe_request(inputs.model.config, inputs.task, inputs.setup)
    return traced_estimate(run_trace(request, log), inputs.task, inputs.setup)


def recommend_closed_form(inputs: PlanInputs) -> Recommendation:
    spec = inputs.closed_form_spec()
    return _recommend(inputs, closed_form(spec), "closed-form estimate", CLOSED_FORM_HEADROOM)


def _worst_setup(inputs: PlanInputs) -> TrainSetup:
    """The most demanding stage's setup (the most sequences per example), or the setup."""
    setups = [
        dataclasses.replace(inputs.setup, n_positives=s.stage.n_positives, n_negatives=s.stage.n_negatives)
        for s in inputs.stages
    ] or [inputs.setup]
    return max(setups, key=lambda s: s.sequences_per_example)


def _first_guess(inputs: PlanInputs, setup: TrainSetup) -> int:
    """Where a search by probes or traces starts: the closed form's largest batch, else the setup's."""
    if inputs.spec is None:
        return setup.micro_batch
    limit = inputs.budget.search_limit(CLOSED_FORM_HEADROOM)
    return max(1, largest_batch(closed_form(inputs.spec), setup, limit))


def measure_probes(inputs: PlanInputs, log: Callable[[str], None] = lambda message: None) -> MeasuredPlan:
    """Probe the most demanding stage (or the setup) on the GPU, starting from the closed-form guess."""
    measuring_gpu(inputs.profile.run.device)
    worst = _worst_setup(inputs)
    return measure(
        _requests(inputs, _gpu(inputs)),
        worst.sequences_per_example,
        inputs.budget,
        _first_guess(inputs, worst),
        log=log,
    )


def trace_probes(inputs: PlanInputs, log: Callable[[str], None] = lambda message: None) -> MeasuredPlan:
    """The measured tier's search with traces for probes (no GPU): two or three traces bracket the largest
    micro-batch under the budget less `TRACED_HEADROOM` on a line, and one more confirms it (seconds each)."""
    worst = _worst_setup(inputs)
    plan = measure(
        _requests(inputs),
        worst.sequences_per_example,
        _traced_budget(inputs),
        _first_guess(inputs, worst),
        probe=_traced_probe(inputs),
        log=log,
        noun="trace",
    )
    return dataclasses.replace(plan, tier=TRACED)


def _requests(inputs: PlanInputs, device: str = "cuda") -> Callable[[int], dict[str, Any]]:
    """The probe request of the most demanding stage (or the setup) at a micro-batch (`_search_setup`)."""
    return lambda b: probe_request(inputs.model.config, inputs.task, _search_setup(inputs, b), device)


def _search_setup(inputs: PlanInputs, micro_batch: int) -> TrainSetup:
    """The most demanding stage's setup at `micro_batch` with the accumulation the search gives it for the effective
    batch, 2 standing for any above 1: from the second micro-batch of a step on, the gradients of the ones before
    are kept, which raises the peak by up to their size (a mixture-of-experts model trained in full: 2.9 GiB, 11% of
    its peak at 8 x 8, which traces at accumulation 1 missed; benchmarks/results/planner_recommend_all_H200.md)."""
    worst = _worst_setup(inputs)
    return worst.with_batch(micro_batch, min(2, accumulate_for(micro_batch, inputs.target, worst.n_gpus)))


def _gpu(inputs: PlanInputs) -> str:
    return f"cuda:{device_index(inputs.profile.run.device)}"


def _traced_budget(inputs: PlanInputs) -> Budget:
    """The budget traces are judged against: the plan's, less the share kept back for the trace's error."""
    return Budget(inputs.budget.gpu_total, inputs.budget.margin * (1 - TRACED_HEADROOM))


def _traced_probe(inputs: PlanInputs) -> Callable[[Mapping[str, Any]], ProbeResult]:
    """A probe that traces the request's training step on fake tensors instead of running it."""
    context = Overheads().context

    def traced_probe(request: Mapping[str, Any]) -> ProbeResult:
        setup = _search_setup(inputs, int(request["micro_batch"]))
        est = traced_estimate(run_trace(request), inputs.task, setup)
        return ProbeResult(
            setup.micro_batch,
            setup.sequences,
            setup.accumulate,
            max_reserved=est.reserved,
            max_allocated=est.allocated,
            context=context,
            seconds=est.seconds,
        )

    return traced_probe


def recommend_traced(
    inputs: PlanInputs, plan: MeasuredPlan, log: Callable[[str], None] = lambda message: None
) -> tuple[Recommendation, MeasuredPlan]:
    """The traced tier's recommendation with its micro-batch confirmed by a trace of its own (`confirm_choice`),
    and the plan with that trace: a line through the bracketing traces need not hold between them."""
    requests, probe = _requests(inputs), _traced_probe(inputs)
    return confirm_choice(
        plan,
        lambda p: _recommend(inputs, p.peak_model(), TRACED, TRACED_HEADROOM),
        lambda b: probe(requests(b)),
        _traced_budget(inputs),
        log,
        noun="trace",
    )


def recommend_measured(
    inputs: PlanInputs, plan: MeasuredPlan, log: Callable[[str], None] = lambda message: None
) -> tuple[Recommendation, MeasuredPlan]:
    """The measured tier's recommendation with its micro-batch confirmed by a probe of its own (`confirm_choice`),
    and the plan with that probe."""
    requests = _requests(inputs, _gpu(inputs))
    return confirm_choice(
        plan,
        lambda p: _recommend(inputs, p.peak_model(), "measured", p.headroom),
        lambda b: run_probe(requests(b)),
        inputs.budget,
        log,
    )


def measurable_here(inputs: PlanInputs) -> bool:
    """Whether probes can measure this plan on this machine: run.device is a GPU that NVML finds, and the budget
    is that GPU's memory (a card named by gpu_memory_gb may be another one)."""
    if inputs.profile.plan.gpu_memory_gb != "auto":
        return False
    try:
        return measuring_gpu(inputs.profile.run.device).total == inputs.gpu.total
    except UserError:
        return False


def recommend_preferred(
    inputs: PlanInputs, log: Callable[[str], None] = lambda message: None
) -> tuple[Recommendation, MeasuredPlan | None]:
    """The measured recommendation when `measurable_here`, else the closed form's (and no measured plan)."""
    if not measurable_here(inputs):
        return recommend_closed_form(inputs), None
    return recommend_measured(inputs, measure_probes(inputs, log), log)


def _recommend(inputs: PlanInputs, peak: PeakModel, tier: str, headroom: float = 0.0) -> Recommendation:
    p = inputs.profile.plan
    stages = [s.stage for s in inputs.stages]
    return recommend(peak, inputs.setup, inputs.budget, inputs.target, p.accumulation, stages, tier, headroom)


def planned_patches(inputs: PlanInputs, rec: Recommendation, tune_samples: bool = False) -> list[FilePatch]:
    """Verified previews writing the recommendation into the config (and stage files that set these values)."""
    if inputs.config is None:
        raise UserError("no training config to write to: give --config FILE (or plan.config)")
    values: dict[str, Scalar] = {"batch_size": rec.chosen.micro_batch}
    if rec.chosen.accumulate != 1 or inputs.config.get("accumulate") is not None:
        values["accumulate"] = rec.chosen.accumulate
    edits: list[tuple[Path, ValueEdit]] = inputs.config.edits(values)
    for stage_file, plan in zip(inputs.stages, rec.stages):
        own = {role: v for role, v in values.items() if stage_file.config.get(role) is not None}
        if tune_samples:
            own.update(n_positives=plan.max_positives, n_negatives=plan.max_negatives)
        edits += stage_file.config.edits(own)
    return trainconfig.preview_edits(edits)
