"""Files around a memory plan, read without torch: the plan a run saved (results/plan.json, written by the plan
run kind) and the config files a plan writes into."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.planner.compose import compose
from gpuopt_tui.core.planner.fit import ProbeResult
from gpuopt_tui.core.planner.resolve import Resolved
from gpuopt_tui.core.planner.search import Budget, Candidate, Recommendation, Stage, StagePlan
from gpuopt_tui.core.profiles.plan import PlanSection
from gpuopt_tui.core.runs.layout import RunDir

PLAN_JSON = "plan.json"
CONFIG_DIFF = "config.diff"  # what `plan --apply` would change in the config, beside the plan


@dataclass(frozen=True)
class Probes:
    """The probes behind a measured plan, in the order they ran, and the micro-batch the last one confirmed."""

    results: tuple[ProbeResult, ...]
    confirmed: int


@dataclass(frozen=True)
class SavedPlan:
    """What a plan run found: the recommendation of its tier (closed-form or measured) and the current setup."""

    path: Path
    model: str
    current_total: int  # bytes the config as it was needs (closed form)
    recommendation: Recommendation
    notes: tuple[str, ...]
    probes: Probes | None = None  # for a measured plan
    values: tuple[Resolved, ...] = ()  # every value planned for, with its source (none in older plans)
    warnings: tuple[str, ...] = ()


def read_saved_plan(run_dir: Path) -> SavedPlan:
    """results/plan.json of a plan run; UserError when it is missing or not a plan this version can read."""
    path = RunDir(run_dir).results / PLAN_JSON
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: the run saved no plan") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read it ({e})") from None
    try:
        budget = Budget(int(data["gpu_total_bytes"]), float(data["margin"]))
        return SavedPlan(
            path=path,
            model=str(data["model"]),
            current_total=int(data["current"]["total"]),
            recommendation=_recommendation(data["recommendation"], budget),
            notes=tuple(str(n) for n in data.get("notes", ())),
            probes=_probes(data["measured"]) if data.get("measured") else None,
            values=tuple(_resolved(v) for v in data.get("values", ())),
            warnings=tuple(str(w) for w in data.get("warnings", ())),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path}: not a plan this version can read ({type(e).__name__}: {e})") from None


def _recommendation(rec: Mapping[str, Any], budget: Budget) -> Recommendation:
    return Recommendation(
        budget=budget,
        target=int(rec["target_effective_batch"]),
        mode=str(rec["mode"]),
        b_max=int(rec["largest_micro_batch"]),
        b_max_accumulate=int(rec.get("largest_micro_batch_accumulate", 1)),
        chosen=Candidate(**rec["chosen"]),
        candidates=tuple(Candidate(**c) for c in rec["candidates"]),
        current=Candidate(**rec["current"]) if rec.get("current") else None,
        stages=tuple(StagePlan(**{**s, "stage": Stage(**s["stage"])}) for s in rec["stages"]),
        tier=str(rec["tier"]),
        headroom=_share(rec.get("headroom", 0.0)),  # none before the closed form kept any back
        within_reserve=Candidate(**rec["within_reserve"]) if rec.get("within_reserve") else None,
    )


def _resolved(v: Mapping[str, Any]) -> Resolved:
    value = v["value"]
    return Resolved(
        str(v["role"]),
        str(v["label"]),
        tuple(value) if isinstance(value, list) else value,
        str(v["source"]),
        str(v["origin"]),
        tuple(str(o) for o in v.get("overridden", ())),
        str(v.get("note", "")),
    )


def _share(value: Any) -> float:
    share = float(value)
    if not 0 <= share < 1:
        raise ValueError(f"headroom {share}: expected a share of the budget, at least 0 and below 1")
    return share


def _probes(measured: Mapping[str, Any]) -> Probes:
    """The probes as the plan run kind saves them (bytes throughout)."""
    results = tuple(
        ProbeResult(
            micro_batch=int(p["micro_batch"]),
            sequences=int(p["sequences"]),
            accumulate=int(p.get("accumulate", 1)),  # plans saved before probes ran at the batch's accumulation
            oom=bool(p["oom"]),
            max_reserved=int(p["peak_reserved"]),
            max_allocated=int(p["peak_allocated"]),
            num_alloc_retries=int(p["alloc_retries"]),
            context=int(p["context"]),
            seconds=float(p["seconds"]),
            error=str(p["error"]),
            drift=int(p.get("drift", 0)),  # plans saved before probes measured their drift have none
        )
        for p in measured["probes"]
    )
    return Probes(results, int(measured["confirmed_micro_batch"]))


def config_files(plan: PlanSection) -> list[Path]:
    """The files a plan may write into: every file of the composed config, then the stage files (each once)."""
    if not plan.config:
        raise UserError("no training config: set plan.config (the YAML file the plan writes into)")
    files = [layer.path for layer in compose(Path(plan.config).expanduser(), plan.overrides).layers]
    files += [Path(s).expanduser() for s in plan.stages]
    return list(dict.fromkeys(files))
