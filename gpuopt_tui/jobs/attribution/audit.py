"""The audit of an attribution run: a few of its samples, chosen at random and named, attributed again with a
strict reference, and the error of the run's token scores against it reported beside the tolerance.

The reference runs the same samples on the model's own forward (no lean last layer, no fused attention kernels,
no compilation, no reduced-precision weights) in strict fp32 (no TF32), with the adaptive panels to a tenth of the
run's tolerance (1e-4 for runs with fixed steps) and up to REFERENCE_MAX_STEPS points. It checks the precision,
the optimized forward and the stopping of the run on samples of its own data. It shares the rule's assumption that
the panels resolve the integrand (adaptive.py); benchmarks/ig_conformance.py checks the rule against fixed
Gauss-Legendre and finer references on trained models of several families. Its error is the per-sample figure
max |run - reference| / max |reference| over the sample's token scores.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any

import torch
from torch import Tensor

from gpuopt_tui.jobs.attribution.check import relative_difference
from gpuopt_tui.jobs.attribution.engine import Settings, attribute_batch
from gpuopt_tui.jobs.context import StageFn, no_stage
from gpuopt_tui.jobs.data import TextDataset, trim_batch
from gpuopt_tui.jobs.models import Adapter, to_device

AUTO_SAMPLES = {"cuda": 4, "cpu": 2}  # audit_samples = "auto": per device type (others: the CPU's)
REFERENCE_SHARE = 0.1  # the reference's tolerance, as a share of the run's
FIXED_REFERENCE_TOLERANCE = 1e-4  # the reference's tolerance for runs with fixed steps
REFERENCE_MAX_STEPS = 8193
SEED = 0  # the samples audited: the same for the same data, so that a rerun audits them again
STAGE = "audit: strict fp32 reference"


def audit_count(setting: int | str, device: torch.device) -> int:
    """How many samples `attribution.audit_samples` asks for on `device`."""
    if setting == "auto":
        return AUTO_SAMPLES.get(device.type, AUTO_SAMPLES["cpu"])
    return int(setting)


def chosen_samples(n_samples: int, count: int) -> list[int]:
    """The indices audited, at random (seeded) among the run's samples, in dataset order."""
    return sorted(random.Random(SEED).sample(range(n_samples), min(count, n_samples)))


def reference_settings(settings: Settings) -> Settings:
    """The run's settings as the reference runs them (the module docstring)."""
    ig = settings.ig
    tolerance = REFERENCE_SHARE * ig.tolerance if ig.n_steps == "auto" else FIXED_REFERENCE_TOLERANCE
    reference = settings.with_ig(
        n_steps="auto",
        tolerance=tolerance,
        max_steps=REFERENCE_MAX_STEPS,
        precision="fp32",
        cast_weights=False,
        full_precision_fallback=False,
    )
    # auto steps run batched (the model's own forward: `plain`)
    return dataclasses.replace(reference, optimized=True, compile=False)


def audit(
    adapter: Adapter,
    ds: TextDataset,
    indices: list[int],
    run_scores: Tensor,
    run_target: Tensor,
    run_within: Tensor | None,
    settings: Settings,
    stage: StageFn = no_stage,
) -> dict[str, Any]:
    """The audit of the samples `indices` of `ds`, whose token scores the run gave as `run_scores` [N, *S] (dataset
    order, zero on padding) for the outputs `run_target` [N], with its verdicts `run_within` [N] (None: fixed
    steps). A silent miss is an audited sample the run reported within the tolerance that is above it."""
    reference = reference_settings(settings)
    batch = to_device(trim_batch(ds.batch(indices), ds.token_fields), adapter.device)
    stage(STAGE, 0, len(indices), "samples")
    start = time.perf_counter()
    values = attribute_batch(
        adapter, batch, reference, reference.planner(), target=run_target[indices].to(adapter.device), plain=True
    )
    seconds = time.perf_counter() - start
    stage(STAGE, len(indices), len(indices), "samples")
    ref = values["token_scores"]
    ours = run_scores[indices][..., : ref.shape[-1]]
    errors = relative_difference(ours, ref).tolist()
    tolerance = settings.ig.tolerance if settings.ig.n_steps == "auto" else None
    samples = [
        {
            "index": i,
            "error": error,
            "within": None if tolerance is None else error <= tolerance,
            "reported_within": None if run_within is None else bool(run_within[i]),
            "reference_steps": int(steps),
            "reference_settled": bool(within),
        }
        for i, error, steps, within in zip(indices, errors, values["steps"], values["within"])
    ]
    return {
        "samples": samples,
        "max_error": max(errors, default=0.0),
        "tolerance": tolerance,
        "above": None if tolerance is None else sum(not s["within"] for s in samples),
        "silent_misses": None if tolerance is None else sum(not s["within"] and s["reported_within"] for s in samples),
        "reference": f"strict fp32, the model's own forward, adaptive panels to {reference.ig.tolerance:g}",
        "seconds": seconds,
    }


def audit_warning(result: dict[str, Any]) -> str | None:
    """What a run whose audited samples are above its tolerance says, with the remedies."""
    if not result["above"]:
        return None
    above = [s for s in result["samples"] if not s["within"]]
    named = ", ".join(f"#{s['index']} ({s['error']:.1e})" for s in above)
    lead = (
        f"audit: {len(above)} of {len(result['samples'])} audited samples are above the tolerance "
        f"{result['tolerance']:g} against a strict fp32 reference: {named}"
    )
    if not result["silent_misses"]:
        return f"{lead}; the run flags each of them above the tolerance too (see its steps warning)"
    return (
        f"{lead}; {result['silent_misses']} of them the run reported within it (its error estimate missed): lower "
        "attribution.tolerance, or run the steps in full precision (use_amp = false), and see the audit in "
        "summary.json"
    )


def audit_outcome(result: dict[str, Any]) -> str:
    """The outcome line of a run's audit."""
    count = len(result["samples"])
    cost = f"{result['seconds']:.1f} s"
    if result["tolerance"] is None:
        return f"{count} samples, max error {result['max_error']:.1e} against a strict fp32 reference ({cost})"
    return (
        f"{count - result['above']} of {count} samples within {result['tolerance']:g} (max error "
        f"{result['max_error']:.1e} against a strict fp32 reference; {cost})"
    )
