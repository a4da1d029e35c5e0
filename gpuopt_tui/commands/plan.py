"""`gpuopt-tui plan`: training memory of a config, the batch/accumulation that fits, and writing it back.

gpuopt-tui plan --config conf/config.yaml --show        # breakdown of the current setup
gpuopt-tui plan --config conf/config.yaml --auto        # candidates under margin x GPU memory
gpuopt-tui plan --config conf/config.yaml --apply       # diff, confirm, write with a numbered backup
gpuopt-tui plan --config conf/config.yaml --profile     # measure with probes on the GPU, then recommend
gpuopt-tui plan --config conf/config.yaml --undo        # diff, confirm, restore the newest backups

--auto and --apply measure when this machine has the GPU planned for (run.device, its memory detected), else
they search the closed-form estimate, which keeps a share of the budget back for its error; --gpu-memory GB
plans for a card of that size by the closed form, without probes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.syntax import Syntax
from rich.text import Text

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.format import human_bytes
from gpuopt_tui.core.planner import apply, session
from gpuopt_tui.core.planner.estimate import Estimate
from gpuopt_tui.core.planner.measure import ALLOC_CONF, MeasuredPlan, measure_setup
from gpuopt_tui.core.planner.resolve import Origins
from gpuopt_tui.core.planner.search import Recommendation
from gpuopt_tui.core.planner.traced import TRACE_LIMITS
from gpuopt_tui.core.planner.train_setup import LOOPS
from gpuopt_tui.core.planner.yamledit import MAX_CONFIG_BYTES
from gpuopt_tui.core.profiles.io import (
    apply_overrides,
    find_profile,
    load_profile,
    parse_override,
    profile_from_data,
)
from gpuopt_tui.core.profiles.plan import PlanProfile
from gpuopt_tui.core.profiles.schema import to_plain
from gpuopt_tui.core.results.plan import config_files
from gpuopt_tui.ui.plan_report import (
    STAGES_TITLE,
    breakdown_table,
    candidates_table,
    header_lines,
    layout_line,
    modules_table,
    recommendation_text,
    stages_table,
    tiers_table,
    values_table,
    warning_lines,
)

NAME = "plan"
LARGE_YAML = 256 * 1024  # bytes from which reading a config is announced
HELP = "training memory: estimate or measure, find the micro-batch/accumulation that fits, write the YAML config"

# command-line flag -> plan profile key
FLAG_KEYS = {
    "config": "config",
    "task": "task",
    "precision": "precision",
    "optimizer": "optimizer",
    "trainable": "trainable",
    "lora_rank": "lora_rank",
    "lora_targets": "lora_targets",
    "checkpointing": "gradient_checkpointing",
    "seq_len": "seq_len",
    "batch": "micro_batch",
    "accumulate": "accumulate",
    "effective_batch": "effective_batch",
    "accumulation": "accumulation",
    "positives": "n_positives",
    "negatives": "n_negatives",
    "gpus": "n_gpus",
    "zero_stage": "zero_stage",
    "loop": "loop",
    "margin": "margin",
    "gpu_memory": "gpu_memory_gb",
    "stages": "stages",
    "keys": "keys",
    "overrides": "overrides",
}


def configure(parser: argparse.ArgumentParser) -> None:
    what = parser.add_argument_group("what to do (default: --show and --auto)")
    what.add_argument("--show", action="store_true", help="the current setup's memory, component by component")
    what.add_argument(
        "--auto",
        action="store_true",
        help="search micro-batch and accumulation under the budget (measured when this machine has the GPU)",
    )
    what.add_argument("--apply", action="store_true", help="write the recommendation into the config (diff first)")
    what.add_argument("--yes", action="store_true", help="with --apply/--undo: do not ask for confirmation")
    what.add_argument(
        "--profile", action="store_true", help="measure with probes on the GPU, or fail when there is none"
    )
    what.add_argument(
        "--trace",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --show: also trace the step on fake tensors, any architecture, no GPU (default: only when the "
        "closed form does not cover the model)",
    )
    what.add_argument(
        "--tune-samples", action="store_true", help="with stages: also write the largest n_positives/n_negatives"
    )
    what.add_argument(
        "--undo", action="store_true", help="undo the last --apply: restore the newest NAME.backup.N copies"
    )
    what.add_argument(
        "--force", action="store_true", help="with --undo: restore even files edited after the planner wrote them"
    )

    src = parser.add_argument_group("inputs")
    src.add_argument("--config", metavar="FILE", help="training YAML config (Hydra-style defaults lists supported)")
    src.add_argument("--model", metavar="DIR", help="model directory or config.json (default: the demo classifier)")
    src.add_argument("--from", dest="from_profile", metavar="PROFILE", help="start from a plan profile (name or .toml)")
    src.add_argument(
        "--set", dest="set_values", action="append", default=[], metavar="KEY=VALUE", help="override a profile value"
    )
    src.add_argument(
        "--stage", dest="stages", action="append", metavar="FILE", help="a curriculum stage file (repeatable)"
    )
    src.add_argument(
        "--key", dest="keys", action="append", metavar="ROLE=KEY", help="where a value sits, e.g. batch_size=data.bs"
    )
    src.add_argument(
        "--override",
        dest="overrides",
        action="append",
        metavar="GROUP=OPTION",
        help="composed config choice, e.g. experiment=big",
    )

    setup = parser.add_argument_group(
        "training setup (each value: this flag, else the config's, else the profile's, else a default)"
    )
    setup.add_argument("--task", choices=("auto", "classification", "causal_lm", "masked_lm", "embedding"))
    setup.add_argument("--precision", choices=("fp32", "bf16-mixed", "fp16-mixed"))
    setup.add_argument("--optimizer", choices=("adamw", "sgd", "adam8bit"))
    setup.add_argument("--trainable", choices=("all", "frozen_encoder", "lora"))
    setup.add_argument("--lora-rank", type=int, metavar="R")
    setup.add_argument(
        "--lora-targets",
        type=lambda s: [t for t in s.split(",") if t],
        metavar="A,B",
        help="e.g. query,value or all-linear",
    )
    setup.add_argument(
        "--checkpointing", action=argparse.BooleanOptionalAction, default=None, help="gradient checkpointing"
    )
    setup.add_argument("--seq-len", type=int, metavar="N")
    setup.add_argument("--batch", type=int, metavar="N", help="micro-batch for --show")
    setup.add_argument("--accumulate", type=int, metavar="N", help="gradient accumulation steps for --show")
    setup.add_argument(
        "--effective-batch", type=int, metavar="N", help="effective batch to keep (default: the config's)"
    )
    setup.add_argument(
        "--accumulation", choices=("exact", "approx"), help="exact: divisors; approx: show the deviation"
    )
    setup.add_argument("--positives", type=int, metavar="N", help="n_positives per anchor")
    setup.add_argument("--negatives", type=int, metavar="N", help="n_negatives per anchor")
    setup.add_argument("--gpus", type=int, metavar="N", help="data-parallel GPUs")
    setup.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3))
    setup.add_argument(
        "--loop",
        choices=LOOPS,
        help="the training loop to plan and probe for: hf (Trainer), lightning or plain (default: the profile's)",
    )

    budget = parser.add_argument_group("budget")
    budget.add_argument(
        "--gpu-memory",
        type=float,
        metavar="GB",
        help="plan for a card of this size, by the closed-form estimate (default: the GPU here, measured)",
    )
    budget.add_argument("--margin", type=float, metavar="F", help="use at most this share of GPU memory (default 0.85)")


def build_profile(args: argparse.Namespace) -> PlanProfile:
    """The plan profile the flags describe (on top of --from PROFILE when given)."""
    if args.from_profile:
        base = load_profile(find_profile(args.from_profile), args.set_values)
        if not isinstance(base, PlanProfile):
            raise UserError(f"{args.from_profile}: a {base.kind} profile, not a plan profile")
        data: dict[str, Any] = {"kind": "plan", **to_plain(base)}
    else:
        data = apply_overrides({"kind": "plan"}, args.set_values)
    plan = data.setdefault("plan", {})
    for flag, key in FLAG_KEYS.items():
        value = getattr(args, flag)
        if value is not None:
            plan[key] = value
    if args.model:
        data["model"] = {"adapter": "hf", "path": args.model}
    profile = profile_from_data(data, args.from_profile or "command line")
    assert isinstance(profile, PlanProfile)
    return profile


def origins(args: argparse.Namespace, profile: PlanProfile) -> Origins:
    """Which plan values the command line set (flags and --set plan.KEY), and the profile the others come from."""
    flags = {key: _flag_name(args, flag) for flag, key in FLAG_KEYS.items() if getattr(args, flag) is not None}
    for item in args.set_values:
        key = parse_override(item)[0]
        key = key if "." in key else f"plan.{key}"
        section, _, leaf = key.partition(".")
        if section == "plan":
            flags[leaf] = f"--set {item}"
        elif section == "model":
            flags["model"] = f"--set {item}"
    if args.model:
        flags["model"] = "--model"
    return Origins(flags, f"profile {profile.name}" if args.from_profile else None)


def _flag_name(args: argparse.Namespace, flag: str) -> str:
    if flag == "checkpointing":
        return "--checkpointing" if args.checkpointing else "--no-checkpointing"
    return "--" + flag.replace("_", "-")


def run(args: argparse.Namespace) -> int:
    out = Console(highlight=False)
    profile = build_profile(args)
    if args.undo:
        return _undo(out, profile, args.yes, args.force)
    _note_large_files(out, profile)
    inputs = session.prepare(profile, origins=origins(args, profile))
    show = args.show or not (args.auto or args.apply or args.profile)
    search = args.auto or args.apply or args.profile or not args.show
    _header(out, inputs)
    if show:
        closed = session.estimate_current(inputs) if inputs.spec is not None else None
        if closed is not None:
            _breakdown(out, closed, inputs)
        if args.trace or (args.trace is None and closed is None):
            _traced(out, inputs, closed)
        if args.profile:
            _measured_current(out, inputs)
    if not search:
        return 0
    rec = _search(out, inputs, args.profile or profile.plan.measure, bool(args.trace))
    _recommendation(out, rec)
    if args.apply:
        return _apply(out, inputs, rec, args.tune_samples, args.yes)
    return 0


def _search(out: Console, inputs: session.PlanInputs, measure: bool, trace: bool) -> Recommendation:
    """With `measure` (--profile or plan.measure) the measured tier, or an error saying why it cannot measure here;
    otherwise the measured tier when this machine has the GPU planned for, else the traced tier with `trace`
    (--trace) or where the closed form does not cover the model, else the closed-form estimate."""

    def log(line: str) -> None:
        out.print(Text(f"  {line}"))

    if measure or session.measurable_here(inputs):
        gpu = session.measuring_gpu(inputs.profile.run.device)
        out.print(
            Text.assemble(("measuring ", "bold"), f"on {gpu.label}: training steps probed, each in a fresh process")
        )
    if measure:
        plan = session.measure_probes(inputs, log)
        _measured(out, plan)
        return session.recommend_measured(inputs, plan, log)[0]
    if (trace or inputs.spec is None) and not session.measurable_here(inputs):
        out.print(Text.assemble(("tracing ", "bold"), "the search: each micro-batch traced on fake tensors (seconds)"))
        plan = session.trace_probes(inputs, log)
        _measured(out, plan)
        return session.recommend_traced(inputs, plan, log)[0]
    rec, preferred = session.recommend_preferred(inputs, log)
    if preferred is not None:
        _measured(out, preferred)
    return rec


# --- output --------------------------------------------------------------------------------------------------


def _header(out: Console, inputs: session.PlanInputs) -> None:
    for line in header_lines(inputs):
        out.print(line)
    layout = layout_line(inputs)
    if layout is not None:
        out.print(layout)
    out.print(values_table(inputs.values))
    for line in warning_lines(inputs.warnings):
        out.print(line)
    for note in inputs.notes:
        out.print(f"[yellow]note[/] {note}")


def _breakdown(out: Console, est: Estimate, inputs: session.PlanInputs) -> None:
    out.print(breakdown_table(est, title=f"current setup: {est.tier}, peak at {est.phase}"))
    verdict = "within" if est.total <= inputs.budget.limit else "[red]over[/]"
    out.print(
        f"the current setup uses {est.total / inputs.gpu.total:.0%} of the GPU, {verdict} the "
        f"{inputs.budget.margin:.0%} budget"
    )


def _traced(out: Console, inputs: session.PlanInputs, closed: Estimate | None) -> None:
    """Trace the current setup on fake tensors and print its breakdown beside the closed form's figure."""
    family = inputs.model.config.get("model_type", "model")
    out.print(
        Text.assemble(
            ("tracing ", "bold"),
            f"one {family} training step on fake tensors in a child process (no GPU, no weights; seconds)",
        )
    )
    traced = session.trace_current(inputs, lambda line: out.print(Text(f"  {line}", style="dim")))
    title = f"current setup: {traced.tier}, {traced.model_class}, peak in the {traced.phase} ({traced.seconds:.1f} s)"
    out.print(breakdown_table(traced, title=title))
    out.print(modules_table(traced, title="activations at the traced peak, by module"))
    if closed is not None:
        out.print(tiers_table(traced, closed))
    else:
        out.print(Text.assemble(("closed form ", "bold yellow"), f"no estimate: {inputs.refusal}"))
    out.print(Text(TRACE_LIMITS, style="dim"))


def _measured_current(out: Console, inputs: session.PlanInputs) -> None:
    """Probe the current setup on the GPU and print what it used beside the closed form's figure."""
    gpu = session.measuring_gpu(inputs.profile.run.device)
    setup = inputs.setup
    out.print(Text.assemble(("measuring ", "bold"), f"the current setup on {gpu.label} ({setup.loop} loop)"))
    device = f"cuda:{session.device_index(inputs.profile.run.device)}"
    r = measure_setup(inputs.model.config, inputs.task, setup, device)
    if r.oom:
        out.print(f"[red]measured: micro-batch {setup.micro_batch} runs out of GPU memory[/]")
        return
    closed = session.estimate_current(inputs).total
    out.print(
        f"measured: {human_bytes(r.footprint)} ({r.footprint / inputs.gpu.total:.0%} of the GPU; peak reserved "
        f"{human_bytes(r.max_reserved)} + context {human_bytes(r.context)}) over {len(r.step_peaks)} steps; "
        f"rose {human_bytes(r.drift)} after warm-up; {r.num_alloc_retries} allocator retries; "
        f"closed form {closed / r.footprint - 1:+.1%}"
    )


def _recommendation(out: Console, rec: Recommendation) -> None:
    out.print(candidates_table(rec, title=f"candidates ({rec.tier}), effective batch target {rec.target}"))
    out.print(recommendation_text(rec))
    if rec.stages:
        out.print(stages_table(rec.stages, title=STAGES_TITLE))


def _measured(out: Console, plan: MeasuredPlan) -> None:
    if plan.fit is not None:
        out.print(
            f"{plan.tier}: peak reserved = {human_bytes(plan.fit.intercept)} + {human_bytes(plan.fit.slope)} per "
            f"sequence; context {human_bytes(plan.context)}; b_max {plan.b_max}"
        )
    retries = f" ({plan.confirmed.num_alloc_retries} allocator retries)" if plan.tier == "measured" else ""
    out.print(f"confirmed micro-batch {plan.micro_batch}: {human_bytes(plan.confirmed.footprint)}{retries}")


# --- writing -------------------------------------------------------------------------------------------------


def _note_large_files(out: Console, profile: PlanProfile) -> None:
    """Say so before the wait that a large YAML file brings (read at about 150 KB/s, and again to check an edit)."""
    p = profile.plan
    for name in [p.config, *p.stages] if p.config else p.stages:
        try:
            size = Path(name).expanduser().stat().st_size
        except OSError:
            continue  # reading it says what is wrong
        if LARGE_YAML <= size <= MAX_CONFIG_BYTES:
            out.print(Text(f"reading {name} ({human_bytes(size)}): a YAML file this large takes a while"))


def _confirm(out: Console, question: str, yes: bool) -> bool:
    if yes:
        return True
    if not sys.stdin.isatty():
        raise UserError("not asking for confirmation: stdin is not a terminal; pass --yes to write")
    out.print(f"{question} [y/N] ", end="")
    return input().strip().lower() in ("y", "yes")


def _show_diff(out: Console, diff: str) -> None:
    out.print(Syntax(diff, "diff", theme="ansi_dark", background_color="default"))


def _apply(out: Console, inputs: session.PlanInputs, rec: Recommendation, tune: bool, yes: bool) -> int:
    patches = [p for p in session.planned_patches(inputs, rec, tune) if p.changes]
    if not patches:
        out.print("the config already holds the recommended values; nothing to write")
        return 0
    for patch in patches:
        _show_diff(out, patch.diff)
    if not _confirm(out, f"write {len(patches)} file(s), keeping numbered backups?", yes):
        out.print("nothing written")
        return 1
    for w in apply.apply(patches, config_files(inputs.profile.plan)):
        out.print(Text(f"written {w.target}; the previous version is in {w.backup}"))
    out.print(f"run training with PYTORCH_CUDA_ALLOC_CONF={ALLOC_CONF} (as the plan assumes); undo with --undo")
    return 0


def _undo(out: Console, profile: PlanProfile, yes: bool, force: bool) -> int:
    if not profile.plan.config:
        raise UserError("--undo needs --config FILE (the config that was written)")
    restores = apply.undo_preview(config_files(profile.plan))
    if edited := [r for r in restores if r.edits]:
        out.print("changed since the planner wrote them (undo loses these edits):")
        for r in edited:
            _show_diff(out, r.edits)
        if not force:
            names = ", ".join(str(r.path) for r in edited)
            raise UserError(f"{names}: edited after the planner wrote it; nothing was restored (--force restores it)")
    for r in restores:
        _show_diff(out, r.diff)
    if not _confirm(out, f"restore {len(restores)} file(s) from {', '.join(r.backup.name for r in restores)}?", yes):
        out.print("nothing restored")
        return 1
    apply.undo(restores)
    for r in restores:
        out.print(Text(f"restored {r.target} from {r.backup.name} (removed)"))
    return 0
