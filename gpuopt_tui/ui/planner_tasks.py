"""What the planner screen does off the UI thread: read the configs and the plan runs, ask NVML, preview and write
config changes. Each function returns what to show and raises UserError for what the user can fix; none touches
a widget, so the screen calls them from thread workers."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import RenderableType
from rich.text import Text

from gpuopt_tui.core.errors import ProfileError, UserError
from gpuopt_tui.core.format import human_bytes
from gpuopt_tui.core.planner import apply as config_write
from gpuopt_tui.core.planner import gpu as gpu_memory
from gpuopt_tui.core.planner import session
from gpuopt_tui.core.planner.measure import ALLOC_CONF
from gpuopt_tui.core.planner.search import Candidate, Recommendation
from gpuopt_tui.core.planner.traced import TRACE_LIMITS
from gpuopt_tui.core.planner.yamledit import FilePatch
from gpuopt_tui.core.profile_paths import resolve_paths
from gpuopt_tui.core.profiles.io import load_profile
from gpuopt_tui.core.profiles.plan import PlanProfile
from gpuopt_tui.core.results.plan import SavedPlan, config_files, read_saved_plan
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.status import RunInfo
from gpuopt_tui.ui.plan_report import (
    breakdown_bar,
    breakdown_table,
    candidate_bar,
    header_lines,
    layout_line,
    modules_table,
    probes_text,
    tiers_table,
    values_table,
)
from gpuopt_tui.ui.screens.kind import display_path
from gpuopt_tui.ui.widgets.planner_view import TierPlan
from gpuopt_tui.ui.widgets.profile_values import FORM_SOURCE

CLOSED_FORM = "closed-form estimate"


def resolved(profile: PlanProfile, base: Path) -> PlanProfile:
    """A copy with relative file paths (stage files among them) taken from `base` (the profile file's directory),
    as a run takes them; ProfileError naming the key of a file that does not exist."""
    profile = copy.deepcopy(profile)
    resolve_paths(profile, base, FORM_SOURCE)
    return profile


def plan_inputs(profile: PlanProfile) -> session.PlanInputs:
    """session.prepare, with a message naming the profile key when the GPU's memory is neither given nor found."""
    memory = None
    if profile.plan.gpu_memory_gb == "auto":
        index = session.device_index(profile.run.device)
        memory = gpu_memory.detect(index)
        if memory is None:
            raise ProfileError(
                FORM_SOURCE,
                "plan.gpu_memory_gb",
                f"no GPU {index} found here through NVML: give the memory of the card to plan for, in GB "
                "(e.g. 24, or 80 for an A100/H100 80GB)",
            )
    return session.prepare(profile, memory)


# --- the closed-form tier ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClosedForm:
    plan: TierPlan
    config: str  # where the plan writes, and what Undo would restore
    stages: bool  # the plan has curriculum stages


def closed_form(profile: PlanProfile, base: Path) -> ClosedForm:
    """The closed-form estimate of the profile."""
    profile = resolved(profile, base)
    inputs = plan_inputs(profile)
    est = session.estimate_current(inputs)
    plan = TierPlan(
        head=Text(f"{CLOSED_FORM} of {inputs.model.label}, peak at {est.phase}", style="bold"),
        details=[
            *header_lines(inputs),
            *([line] if (line := layout_line(inputs)) else []),
            values_table(inputs.values),
        ],
        rec=session.recommend_closed_form(inputs),
        current=breakdown_bar(est, inputs.gpu.total, inputs.budget.margin, "current setup"),
        breakdown=breakdown_table(est, notes=False, title="current setup, component by component"),
        notes=inputs.notes,
        warnings=inputs.warnings,
    )
    return ClosedForm(plan, config_line(profile), bool(inputs.stages))


# --- the traced tier -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Traced:
    head: Text
    parts: tuple[RenderableType, ...]


def traced(profile: PlanProfile, base: Path, log: Callable[[str], None]) -> Traced:
    """The profile's current setup traced on fake tensors in a child process (seconds), beside the closed form;
    `log` is told what the trace is doing."""
    inputs = plan_inputs(resolved(profile, base))
    est = session.trace_current(inputs, log)
    closed = session.estimate_current(inputs) if inputs.spec is not None else None
    comparison: RenderableType = (
        tiers_table(est, closed)
        if closed is not None
        else Text.assemble(("closed form ", "bold"), (f"no estimate: {inputs.refusal}", "yellow"))
    )
    return Traced(
        head=Text(f"{est.tier}: {est.model_class} of {inputs.model.label}, peak in the {est.phase}", style="bold"),
        parts=(
            breakdown_bar(est, inputs.gpu.total, inputs.budget.margin, "current setup"),
            comparison,
            breakdown_table(est, notes=False, title="current setup, component by component"),
            modules_table(est, title="activations at the peak, by module"),
            Text(TRACE_LIMITS + f" Traced in {est.seconds:.1f} s.", style="dim"),
            *header_lines(inputs),
        ),
    )


def config_line(profile: PlanProfile) -> str:
    if not profile.plan.config:
        return "No training config (plan.config): the plan is not written anywhere."
    files = config_files(profile.plan)
    stages = len(profile.plan.stages)
    parts = [f"Config {display_path(Path(profile.plan.config))}"]
    if len(files) - stages > 1:
        parts.append(f"composed of {len(files) - stages} files")
    if stages:
        parts.append(f"{stages} stage files")
    backups = [b.name for b in config_write.newest_backups(files)]
    parts.append(f"Undo restores {', '.join(backups)}" if backups else "no backups yet")
    return "; ".join(parts)


# --- the measured tier ---------------------------------------------------------------------------------------


def measuring_gpu(profile: PlanProfile) -> gpu_memory.GpuMemory:
    """The GPU the probes would run on; UserError, saying that nothing starts, when there is none."""
    try:
        return session.measuring_gpu(profile.run.device)
    except UserError as e:
        raise UserError(f"{e}, so no run was started. The closed-form estimate needs none.") from None


@dataclass(frozen=True)
class PlanRun:
    """A plan run as the Measured tab sees it."""

    info: RunInfo
    measure: bool  # its profile has plan.measure = true
    gpu: int  # the GPU its probes run on
    saved: SavedPlan | None = None  # once it finished
    error: str = ""  # why its profile or its plan cannot be read


def read_plan_run(info: RunInfo) -> PlanRun:
    try:
        profile = load_profile(RunDir(info.dir).profile)
    except UserError as e:
        return PlanRun(info, False, 0, error=str(e))
    if not isinstance(profile, PlanProfile):
        return PlanRun(info, False, 0)
    run = PlanRun(info, profile.plan.measure, session.device_index(profile.run.device))
    if info.status != "finished":
        return run
    try:
        return dataclasses.replace(run, saved=read_saved_plan(info.dir))
    except UserError as e:
        return dataclasses.replace(run, error=str(e))


def newest_measuring_run(runs: Sequence[RunInfo]) -> PlanRun | None:
    """The newest of the plan runs (newest first) that measures."""
    return next((run for run in map(read_plan_run, runs) if run.measure), None)


def measured_plan(run: PlanRun, saved: SavedPlan) -> TierPlan:
    """The plan a run saved: measured on its GPU, or (plan.measure = false) the closed-form estimate it made."""
    rec = saved.recommendation
    budget = rec.budget
    probes = [probes_text(saved.probes.results, budget.limit, saved.probes.confirmed)] if saved.probes else []
    how = "peaks fitted to probes on the GPU (see its log)" if run.measure else "closed-form estimate, saved"
    return TierPlan(
        head=Text(
            f"measured on GPU {run.gpu} of {saved.model}" if run.measure else f"closed-form estimate of {saved.model}",
            style="bold",
        ),
        details=[
            Text(f"run {run.info.id} ({run.info.name}): {how}"),
            *probes,
            Text(f"budget {budget.margin:.0%} of {human_bytes(budget.gpu_total)} = {human_bytes(budget.limit)}"),
            *([values_table(saved.values)] if saved.values else []),
        ],
        rec=rec,
        current=candidate_bar(rec.current, budget.gpu_total, budget.margin, "current setup") if rec.current else None,
        breakdown=None,
        notes=saved.notes,
        warnings=saved.warnings,
    )


# --- writing the config --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preview:
    question: str
    patches: list[FilePatch]
    files: list[Path]  # every file of the config (their backups number the writes)

    @property
    def diff(self) -> str:
        return "".join(p.diff for p in self.patches)


def preview(
    profile: PlanProfile, base: Path, measured: Recommendation | None, choice: Candidate | None, tune: bool
) -> Preview:
    """The verified patches that write `choice` (else the recommendation of `measured`, else of the closed form)
    into the profile's config, and the question to ask before writing them."""
    profile = resolved(profile, base)
    if not profile.plan.config:
        raise UserError("no training config to write to: set plan.config to the YAML file the training reads")
    inputs = plan_inputs(profile)
    rec = measured or session.recommend_closed_form(inputs)
    if choice is not None:
        rec = dataclasses.replace(rec, chosen=choice)
    patches = [p for p in session.planned_patches(inputs, rec, tune) if p.changes]
    c = rec.chosen
    what = f"micro-batch {c.micro_batch} x accumulate {c.accumulate} ({c.label.strip()}, {rec.tier})"
    if not patches:
        raise UserError(f"the config already holds {what}; nothing to write")
    files = ", ".join(p.path.name for p in patches)
    question = f"Write {what} into {files}? Each file is copied to a numbered NAME.backup.N first."
    return Preview(question, patches, config_files(profile.plan))


def apply(preview: Preview) -> str:
    """Write previewed patches (refused, as a UserError, for a file changed since the preview or read-only)."""
    written = config_write.apply(preview.patches, preview.files)
    return (
        f"wrote {', '.join(w.path.name for w in written)}; the previous version is in "
        f"{', '.join(w.backup.name for w in written)} (Undo restores it). "
        f"Train with PYTORCH_CUDA_ALLOC_CONF={ALLOC_CONF}, as the plan assumes."
    )


def undo_preview(profile: PlanProfile, base: Path) -> list[config_write.Restore]:
    return config_write.undo_preview(config_files(resolved(profile, base).plan))


def undo(restores: Sequence[config_write.Restore]) -> str:
    """Restore the previewed backups (refused, as a UserError, when a file changed since the preview)."""
    config_write.undo(restores)
    return f"restored {', '.join(r.path.name for r in restores)} from {', '.join(r.backup.name for r in restores)}"
