"""The "optimized vs original" check: the batched path against the one-step-at-a-time fp32 loop."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from torch import Tensor

from gpuopt_tui.jobs.attribution.engine import Settings, attribute_batch
from gpuopt_tui.jobs.context import StageFn, no_stage
from gpuopt_tui.jobs.data import TextDataset, trim_batch
from gpuopt_tui.jobs.models import Adapter, to_device

CHECK_AUTO_STEPS = 33  # the steps of both paths when the run's are "auto" (a fixed rule: CHECK_AUTO_METHOD)
CHECK_AUTO_METHOD = "clenshaw_curtis"
#: The stage of each path while it runs (progress in (sample, step) pairs: each shows its own rate).
CHECK_STAGES = {"optimized": "check: optimized path", "original": "check: one step at a time (fp32)"}


def relative_difference(values: Tensor, reference: Tensor) -> Tensor:
    """Per sample: max |values - reference| / max |reference| over its token scores."""
    flat, ref = values.reshape(values.shape[0], -1), reference.reshape(reference.shape[0], -1)
    return (flat - ref).abs().amax(1) / ref.abs().amax(1).clamp_min(1e-30)


def compare_paths(
    adapter: Adapter, ds: TextDataset, settings: Settings, n_samples: int, stage: StageFn = no_stage
) -> dict[str, Any]:
    """Attribute the first `n_samples` samples both ways; the optimized path keeps its precision, the
    original runs in fp32 (with "auto" steps both take CHECK_AUTO_STEPS fixed steps); `stage` hears each
    path's progress (CHECK_STAGES, in steps: samples x n_steps). Returns the max and
    median relative difference of the token scores and timings. The difference can be exactly 0 in fp32 on
    the CPU: for small models the kernels compute each row the same way whatever the batch, so the two paths
    may round identically."""
    if settings.ig.n_steps == "auto":  # the original path has fixed steps: both take the same fixed rule
        settings = settings.with_ig(n_steps=CHECK_AUTO_STEPS, method=CHECK_AUTO_METHOD)
    subset = ds.head(n_samples)
    batch = to_device(trim_batch(subset.batch(list(range(len(subset)))), subset.token_fields), adapter.device)
    scores, seconds = {}, {}
    steps = len(subset) * int(settings.ig.n_steps)
    for name, optimized, prec in (("optimized", True, settings.ig.precision), ("original", False, "fp32")):
        variant = dataclasses.replace(settings.with_ig(precision=prec), optimized=optimized)

        def on_chunk(done: int, total: int, name: str = name) -> None:
            stage(CHECK_STAGES[name], steps * done // total, steps, "steps")

        on_chunk(0, 1)
        start = time.perf_counter()
        scores[name] = attribute_batch(adapter, batch, variant, variant.planner(), on_chunk)["token_scores"]
        seconds[name] = time.perf_counter() - start
    diff = relative_difference(scores["optimized"], scores["original"])
    optimized_s, original_s = seconds["optimized"], seconds["original"]
    return {
        "n_samples": len(subset),
        "n_steps": settings.ig.n_steps,
        "precision_optimized": settings.ig.precision,
        "cast_weights_optimized": settings.ig.cast_weights,
        "precision_original": "fp32",
        "max_rel_diff": float(diff.max()),
        "median_rel_diff": float(diff.median()),
        "seconds_optimized": optimized_s,
        "seconds_original": original_s,
        "speedup": original_s / optimized_s if optimized_s > 0 else None,
    }
