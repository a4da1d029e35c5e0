"""`gpuopt-tui plan`: training memory of a config, the batch/accumulation that fits, and writing it back.

gpuopt-tui plan --config conf/config.yaml --show        # breakdown of the current setup
gpuopt-tui plan --config conf/config.yaml --auto        # candidates under margin x GPU memory
gpuopt-tui plan --config conf/config.yaml --apply       # diff, confirm, write with a .backup
gpuopt-tui plan --config conf/config.yaml --profile     # measure with probes on the GPU, then recommend
gpuopt-tui plan --config conf/config.yaml --undo        # restore the .backup files
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.format import human_bytes
from gpuopt_tui.core.planner import session, yamledit
from gpuopt_tui.core.planner.compose import compose
from gpuopt_tui.core.planner.estimate import Estimate
from gpuopt_tui.core.planner.measure import ALLOC_CONF, MeasuredPlan
from gpuopt_tui.core.planner.search import Candidate, Recommendation
from gpuopt_tui.core.profiles.io import apply_overrides, find_profile, load_profile, profile_from_data
from gpuopt_tui.core.profiles.plan import PlanProfile
from gpuopt_tui.core.profiles.schema import to_plain

NAME = "plan"
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
    what.add_argument("--auto", action="store_true", help="search micro-batch and accumulation under the budget")
    what.add_argument("--apply", action="store_true", help="write the recommendation into the config (diff first)")
    what.add_argument("--yes", action="store_true", help="with --apply/--undo: do not ask for confirmation")
    what.add_argument("--profile", action="store_true", help="measure with probes on the GPU (the measured tier)")
    what.add_argument(
        "--tune-samples", action="store_true", help="with stages: also write the largest n_positives/n_negatives"
    )
    what.add_argument("--undo", action="store_true", help="restore the config files from their .backup copies")

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

    setup = parser.add_argument_group("training setup (default: from the config, else the profile)")
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
    setup.add_argument("--loop", choices=("lightning", "plain"), help="when gradients are freed (default lightning)")

    budget = parser.add_argument_group("budget")
    budget.add_argument("--gpu-memory", type=float, metavar="GB", help="plan for a card of this size (default: NVML)")
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


def run(args: argparse.Namespace) -> int:
    out = Console(highlight=False)
    profile = build_profile(args)
    if args.undo:
        return _undo(out, profile, args.yes)
    inputs = session.prepare(profile)
    show = args.show or not (args.auto or args.apply or args.profile)
    search = args.auto or args.apply or args.profile or not args.show
    _header(out, inputs)
    if show:
        _breakdown(out, session.estimate_current(inputs), inputs)
    if not search:
        return 0
    if args.profile or profile.plan.measure:
        plan = session.measure_probes(inputs, log=lambda line: out.print(f"  {line}"))
        _measured(out, plan)
        rec = session.recommend_measured(inputs, plan)
    else:
        rec = session.recommend_closed_form(inputs)
    _recommendation(out, rec)
    if args.apply:
        return _apply(out, inputs, rec, args.tune_samples, args.yes)
    return 0


# --- output --------------------------------------------------------------------------------------------------


def _header(out: Console, inputs: session.PlanInputs) -> None:
    spec, s = inputs.spec, inputs.setup
    out.print(
        f"[bold]model[/] {inputs.model.label}: {spec.model_type} {spec.task}, {spec.layers} layers, hidden "
        f"{spec.hidden}, {spec.params / 1e6:.1f}M parameters"
    )
    lora = f" (r={s.lora_rank}, {','.join(s.lora_targets)})" if s.trainable == "lora" else ""
    samples = f", {s.n_positives}+{s.n_negatives} samples per anchor" if s.sequences_per_example > 1 else ""
    out.print(
        f"[bold]setup[/] {s.precision}, {s.optimizer}, trains {s.trainable}{lora}, checkpointing "
        f"{'on' if s.gradient_checkpointing else 'off'}, seq {s.seq_len}, micro-batch {s.micro_batch} x "
        f"accumulate {s.accumulate} x {s.n_gpus} GPU(s) = {s.effective_batch}{samples}"
    )
    out.print(
        f"[bold]budget[/] {inputs.budget.margin:.0%} of {human_bytes(inputs.gpu.total)} ({inputs.gpu.label}) = "
        f"{human_bytes(inputs.budget.limit)}"
    )
    for note in inputs.notes:
        out.print(f"[yellow]note[/] {note}")


def _breakdown(out: Console, est: Estimate, inputs: session.PlanInputs) -> None:
    table = Table(
        title=f"current setup: {est.tier}, peak at {est.phase}", box=None, header_style="bold", title_justify="left"
    )
    table.add_column("component")
    table.add_column("size", justify="right")
    table.add_column("at peak", justify="center")
    table.add_column("how", style="dim")
    for c in est.components:
        table.add_row(c.label, human_bytes(c.bytes), "yes" if c.in_peak else "", c.note)
    table.add_section()
    table.add_row(
        "[bold]peak reserved by torch[/]", human_bytes(est.reserved), "", "what torch.cuda.max_memory_reserved() shows"
    )
    table.add_row(
        "[bold]total on the GPU[/]", human_bytes(est.total), "", "with the CUDA context (what nvidia-smi shows)"
    )
    out.print(table)
    verdict = "within" if est.total <= inputs.budget.limit else "[red]over[/]"
    out.print(
        f"the current setup uses {est.total / inputs.gpu.total:.0%} of the GPU, {verdict} the "
        f"{inputs.budget.margin:.0%} budget"
    )


def _utilisation(c: Candidate) -> str:
    colour = "green" if c.fits and c.utilisation >= 0.6 else ("yellow" if c.fits else "red")
    return f"[{colour}]{c.utilisation:.0%}[/]"


def _recommendation(out: Console, rec: Recommendation) -> None:
    table = Table(
        title=f"candidates ({rec.tier}), effective batch target {rec.target}",
        box=None,
        header_style="bold",
        title_justify="left",
    )
    for column in ("", "micro-batch", "accumulate", "effective", "deviation", "memory", "of GPU", "fits"):
        table.add_column(column, justify="left" if not column else "right")
    same = [
        c for c in rec.candidates if (c.micro_batch, c.accumulate) == (rec.chosen.micro_batch, rec.chosen.accumulate)
    ]
    chosen = same[0] if same else rec.chosen
    rows = [c for c in (rec.current, *rec.candidates, *([] if same else [rec.chosen])) if c is not None]
    for c in rows:
        deviation = f"{c.deviation:+.1%}" if c.deviation else "exact"
        table.add_row(
            f"[bold]> {c.label}[/]" if c is chosen else f"  {c.label}",
            str(c.micro_batch),
            str(c.accumulate),
            str(c.effective_batch),
            deviation,
            human_bytes(c.peak),
            _utilisation(c),
            "yes" if c.fits else "[red]no[/]",
        )
    out.print(table)
    out.print(
        f"> recommended ({rec.mode}): micro-batch {rec.chosen.micro_batch} x accumulate {rec.chosen.accumulate}; "
        f"largest micro-batch under the budget: {rec.b_max}"
    )
    if rec.stages:
        stages = Table(title="curriculum stages", box=None, header_style="bold", title_justify="left")
        for column in (
            "stage",
            "n_pos",
            "n_neg",
            "largest micro-batch",
            "memory at chosen",
            "of GPU",
            "most samples at chosen",
        ):
            stages.add_column(column, justify="left" if column == "stage" else "right")
        for p in rec.stages:
            stages.add_row(
                p.stage.name,
                str(p.stage.n_positives),
                str(p.stage.n_negatives),
                str(p.b_max),
                human_bytes(p.peak),
                f"{p.utilisation:.0%}",
                f"{p.max_positives} + {p.max_negatives}",
            )
        out.print(stages)


def _measured(out: Console, plan: MeasuredPlan) -> None:
    if plan.fit is not None:
        out.print(
            f"measured: peak reserved = {human_bytes(plan.fit.intercept)} + {human_bytes(plan.fit.slope)} per "
            f"sequence; context {human_bytes(plan.context)}; b_max {plan.b_max}"
        )
    out.print(
        f"confirmed micro-batch {plan.micro_batch}: {human_bytes(plan.confirmed.footprint)} "
        f"({plan.confirmed.num_alloc_retries} allocator retries)"
    )


# --- writing -------------------------------------------------------------------------------------------------


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
    if not _confirm(out, f"write {len(patches)} file(s), keeping .backup copies?", yes):
        out.print("nothing written")
        return 1
    for backup in yamledit.apply(patches):
        out.print(f"written; the previous version is in {backup}")
    out.print(f"run training with PYTORCH_CUDA_ALLOC_CONF={ALLOC_CONF} (as the plan assumes); undo with --undo")
    return 0


def _undo(out: Console, profile: PlanProfile, yes: bool) -> int:
    p = profile.plan
    if not p.config:
        raise UserError("--undo needs --config FILE (the config that was written)")
    files = [layer.path for layer in compose(Path(p.config).expanduser(), p.overrides).layers]
    files += [Path(s).expanduser() for s in p.stages]
    restorable = list(dict.fromkeys(f for f in files if yamledit.backup_path(f).is_file()))
    if not restorable:
        raise UserError(f"no .backup files next to {', '.join(str(f) for f in dict.fromkeys(files))}")
    for path in restorable:
        _show_diff(out, yamledit.undo_preview(path))
    if not _confirm(out, f"restore {len(restorable)} file(s) from their backups?", yes):
        out.print("nothing restored")
        return 1
    for path in restorable:
        yamledit.undo(path)
        out.print(f"restored {path}")
    return 0
