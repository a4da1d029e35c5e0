"""An attribution run's results/summary.json (the overall token ranking, convergence-delta statistics,
settings and timing) and check.json (when the profile's attribution.check_samples > 0: the optimized path
against the one-step-at-a-time fp32 path on the first samples), read without torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.runs.layout import RunDir

SUMMARY_NAME = RunDir.SUMMARY
CHECK_NAME = "check.json"


@dataclass(frozen=True)
class TokenRank:
    token: str
    mean_share: float  # mean share of its sample's total |attribution| per occurrence
    mean_abs: float
    mean: float
    count: int


@dataclass(frozen=True)
class DeltaStats:
    """Convergence deltas over the samples: absolute and relative to |F(x) - F(baseline)|."""

    median_abs: float
    p95_abs: float
    median_rel: float
    p95_rel: float
    max_rel: float
    threshold_rel: float
    warning: str | None
    suggested_n_steps: int | None


@dataclass(frozen=True)
class StepStats:
    """The interpolation steps the samples used: fixed, or each its own with n_steps = "auto"."""

    mode: str  # "fixed" or "auto"
    tolerance: float | None
    max_steps: int | None
    total: int
    mean: float
    histogram: tuple[tuple[int, int], ...]  # (steps, samples), fewest steps first
    above_tolerance: int | None  # "auto": samples above the tolerance (their relative delta or error estimate)
    warning: str | None
    full_precision: str | None = None  # "auto": how many samples ran their steps in full precision, and why
    above_tolerance_samples: tuple[int, ...] = ()  # "auto": the first of them, by index


@dataclass(frozen=True)
class LowMargin:
    """Samples whose two largest outputs are closer than the steps' precision can tell apart."""

    count: int
    precision: str
    relative_error: float


@dataclass(frozen=True)
class AuditedSample:
    index: int
    error: float  # max |run - reference| / max |reference| over its token scores
    within: bool | None  # within the run's tolerance (None: the run had fixed steps)


@dataclass(frozen=True)
class Audit:
    """Samples of the run attributed again with a strict fp32 reference, and their error against it."""

    samples: tuple[AuditedSample, ...]
    max_error: float
    tolerance: float | None  # the run's (None: fixed steps)
    above: int | None
    reference: str  # how the reference ran, in words
    seconds: float
    silent_misses: int | None = None  # audited samples the run reported within the tolerance that are above it


@dataclass(frozen=True)
class AttributionSummary:
    path: Path
    n_samples: int
    model: str
    data: str
    ranking: str  # how the overall ranking was made, in words
    top_k: tuple[TokenRank, ...]
    deltas: DeltaStats
    settings: dict[str, Any]
    timing: dict[str, Any]
    low_margin: LowMargin | None = None  # None in results written before it was recorded
    steps: StepStats | None = None  # likewise
    audit: Audit | None = None  # None: the audit was off (or the results predate it)


@dataclass(frozen=True)
class CheckResult:
    """The optimized path (its own precision) against the original (one sample and one step at a time, fp32)."""

    path: Path
    n_samples: int
    precision_optimized: str
    cast_weights_optimized: bool
    precision_original: str
    max_rel_diff: float
    median_rel_diff: float
    seconds_optimized: float
    seconds_original: float
    speedup: float | None


def _read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object file; None when it does not exist, UserError when it cannot be read or parsed."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data


def optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def optional_bool(value: Any) -> bool | None:
    return None if value is None else bool(value)


def optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def load_summary(results_dir: Path) -> AttributionSummary | None:
    """results/summary.json, or None before the run wrote it."""
    path = results_dir / SUMMARY_NAME
    data = _read_json(path)
    if data is None:
        return None
    try:
        deltas = data["deltas"]
        return AttributionSummary(
            path=path,
            n_samples=int(data["n_samples"]),
            model=str(data.get("model", "")),
            data=str(data.get("data", "")),
            ranking=str(data.get("ranking", "")),
            top_k=tuple(
                TokenRank(
                    str(t["token"]), float(t["mean_share"]), float(t["mean_abs"]), float(t["mean"]), int(t["count"])
                )
                for t in data["top_k"]
            ),
            deltas=DeltaStats(
                median_abs=float(deltas["median_abs"]),
                p95_abs=float(deltas["p95_abs"]),
                median_rel=float(deltas["median_rel"]),
                p95_rel=float(deltas["p95_rel"]),
                max_rel=float(deltas["max_rel"]),
                threshold_rel=float(deltas["threshold_rel"]),
                warning=deltas.get("warning") or None,
                suggested_n_steps=optional_int(deltas.get("suggested_n_steps")),
            ),
            settings=dict(data.get("settings") or {}),
            timing=dict(data.get("timing") or {}),
            low_margin=_low_margin(data.get("low_margin")),
            steps=_steps(data.get("steps")),
            audit=_audit(data.get("audit")),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path}: not an attribution summary ({type(e).__name__}: {e})") from None


def _low_margin(data: Any) -> LowMargin | None:
    if data is None:
        return None
    return LowMargin(int(data["count"]), str(data["precision"]), float(data["relative_error"]))


def _steps(data: Any) -> StepStats | None:
    if data is None:
        return None
    tolerance = data.get("tolerance")
    return StepStats(
        mode=str(data["mode"]),
        tolerance=None if tolerance is None else float(tolerance),
        max_steps=optional_int(data.get("max_steps")),
        total=int(data["total"]),
        mean=float(data["mean"]),
        histogram=tuple((int(steps), int(count)) for steps, count in data["histogram"]),
        above_tolerance=optional_int(data.get("above_tolerance")),
        warning=data.get("warning") or None,
        full_precision=(data.get("full_precision") or {}).get("note"),
        above_tolerance_samples=tuple(int(i) for i in data.get("above_tolerance_samples") or ()),
    )


def _audit(data: Any) -> Audit | None:
    if data is None:
        return None
    samples = tuple(
        AuditedSample(int(s["index"]), float(s["error"]), None if s["within"] is None else bool(s["within"]))
        for s in data["samples"]
    )
    return Audit(
        samples=samples,
        max_error=float(data["max_error"]),
        tolerance=optional_float(data.get("tolerance")),
        above=optional_int(data.get("above")),
        reference=str(data.get("reference", "")),
        seconds=float(data["seconds"]),
        silent_misses=optional_int(data.get("silent_misses")),
    )


def load_check(results_dir: Path) -> CheckResult | None:
    """results/check.json, or None when the run has no check (yet)."""
    path = results_dir / CHECK_NAME
    data = _read_json(path)
    if data is None:
        return None
    try:
        speedup = data.get("speedup")
        return CheckResult(
            path=path,
            n_samples=int(data["n_samples"]),
            precision_optimized=str(data["precision_optimized"]),
            cast_weights_optimized=bool(data.get("cast_weights_optimized", False)),
            precision_original=str(data["precision_original"]),
            max_rel_diff=float(data["max_rel_diff"]),
            median_rel_diff=float(data["median_rel_diff"]),
            seconds_optimized=float(data["seconds_optimized"]),
            seconds_original=float(data["seconds_original"]),
            speedup=None if speedup is None else float(speedup),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path}: not a check result ({type(e).__name__}: {e})") from None
