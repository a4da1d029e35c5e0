"""How faithful a run's scores are: the same settings and exact all-parameter TracIn (with a PEFT adapter: all of
its trainable parameters) on a small subset, compared by rank (Spearman across training examples, top-10 overlap),
like IG's completeness check.

A run with a bf16/fp16 forward is also scored on the subset with the same settings in fp32: where the training
gradients point nearly the same way (a model barely trained, or confident on everything), their scores differ by
little more than a shared term, and the rounding of a low-precision forward reorders them however fine the
projection. The check then says how much the precision alone costs, and `precision_advice` what to do; where a
projected run agrees below WANTED_SPEARMAN, `projection_advice` names what agrees better."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from gpuopt_tui.jobs.data import TextDataset
from gpuopt_tui.jobs.models.base import Adapter, Checkpoint
from gpuopt_tui.jobs.tracin.agreement import rank_correlation, top_k_overlap
from gpuopt_tui.jobs.tracin.interface import PrefixedReporter, Reporter, TracInOptions
from gpuopt_tui.jobs.tracin.params import select_parameters
from gpuopt_tui.jobs.tracin.scores import tracin_scores

MAX_TEST = 16
AGREEMENT_RUN = "agreement check, the run's settings"  # the stages of its two computations
AGREEMENT_EXACT = "agreement check, exact"
AGREEMENT_FP32 = "agreement check, the run's settings in fp32"
TOP_K = 10
PRECISION_MARGIN = 0.02  # Spearman by which fp32 must beat the run's precision for the check to advise it
WANTED_SPEARMAN = 0.9  # below it, a projected run's check names what agrees better
FULL_REFERENCE = "exact gradients of every Linear, Embedding and LayerNorm parameter, fp32"
ADAPTER_REFERENCE = "exact gradients of every trainable parameter of the PEFT adapter, fp32"


def exact_agreement(
    adapter: Adapter,
    checkpoints: Sequence[Checkpoint],
    train: TextDataset,
    test: TextDataset,
    names: Sequence[str],
    options: TracInOptions,
    n_train: int,
    reporter: Reporter,
) -> dict[str, Any]:
    """Scores of the first `n_train` training and `MAX_TEST` test examples with the run's parameters `names` and
    `options`, and with exact gradients of every parameter (method factored, unprojected, fp32; with a PEFT
    adapter, every parameter it trains), and how they
    agree; for a bf16/fp16 run, also how its settings agree in fp32 (key "fp32")."""
    sub_train = train.head(n_train)
    sub_test = test.head(MAX_TEST)
    probe = sub_test.batch([0])
    everything = adapter.peft_trainable or select_parameters(adapter, probe, "all")
    quiet = dataclasses.replace(options, train_cache=None, keep_matrix=True, top_k=1)
    ours = tracin_scores(
        adapter, checkpoints, sub_train, sub_test, names, quiet, reporter=PrefixedReporter(reporter, AGREEMENT_RUN)
    )
    # Adam-preconditioned gradients are elementwise, which the factored method cannot give: the reference then
    # takes them exactly per parameter (closed form where it applies, else vmap)
    method = "auto" if options.optimizer_state == "adam" else "factored"
    exact_options = dataclasses.replace(
        quiet, method=method, projection_dim=0, projection_in=0, projection_out=0, precision="fp32"
    )
    exact_reporter = PrefixedReporter(reporter, AGREEMENT_EXACT)
    exact = tracin_scores(adapter, checkpoints, sub_train, sub_test, everything, exact_options, reporter=exact_reporter)
    found = {
        "reference": _reference(adapter, options),
        "excluded_from_reference": list(exact.stats["excluded_parameters"]),
        "n_train": len(sub_train),
        "n_test": len(sub_test),
        "spearman": rank_correlation(ours.matrix, exact.matrix),
        "top_k": TOP_K,
        "top_k_overlap": top_k_overlap(ours.matrix, exact.matrix, TOP_K),
        "precision": options.precision,
    }
    if options.precision != "fp32":
        wide = dataclasses.replace(quiet, precision="fp32")
        fp32_reporter = PrefixedReporter(reporter, AGREEMENT_FP32)
        full = tracin_scores(adapter, checkpoints, sub_train, sub_test, names, wide, reporter=fp32_reporter)
        found["fp32"] = {
            "spearman": rank_correlation(full.matrix, exact.matrix),
            "top_k_overlap": top_k_overlap(full.matrix, exact.matrix, TOP_K),
        }
    return found


def _reference(adapter: Adapter, options: TracInOptions) -> str:
    if options.optimizer_state != "adam":
        return FULL_REFERENCE if adapter.peft_trainable is None else ADAPTER_REFERENCE
    which = "every parameter" if adapter.peft_trainable is None else "every trainable parameter of the PEFT adapter"
    return f"exact Adam-preconditioned training gradients of {which}, fp32"


def precision_advice(agreement: dict[str, Any]) -> str | None:
    """What to change when the run's settings in fp32 agree clearly better with exact TracIn than at the run's
    precision (None when they do not, or were not checked)."""
    fp32 = agreement.get("fp32")
    if fp32 is None or fp32["spearman"] < agreement["spearman"] + PRECISION_MARGIN:
        return None
    return (
        f"the {agreement['precision']} forward costs faithfulness: on the agreement subset these settings in fp32 "
        f"reach Spearman {fp32['spearman']:.3f} (top-{agreement['top_k']} overlap {fp32['top_k_overlap']:.0%}) "
        f"against exact TracIn, {agreement['precision']} {agreement['spearman']:.3f} "
        f"({agreement['top_k_overlap']:.0%}); set tracin.use_amp = false for fp32 gradients"
    )


def projection_advice(agreement: dict[str, Any], options: TracInOptions) -> str | None:
    """What agrees better when the run's projection agrees with exact TracIn below WANTED_SPEARMAN (None when it
    does not, or the gradients were not projected, or the precision is what costs: `precision_advice`)."""
    projected = options.projection_in or options.projection_out or options.projection_dim
    if not projected or agreement["spearman"] >= WANTED_SPEARMAN or precision_advice(agreement) is not None:
        return None
    found = f"the projection agrees with exact TracIn at Spearman {agreement['spearman']:.3f} on the agreement subset"
    if options.method == "factored" and options.projection_basis == "random":
        return (
            f'{found}; tracin.projection_basis = "pca" (directions fitted to the data), or larger projection_in and '
            "projection_out, agree better"
        )
    size = "projection_in and projection_out" if options.method == "factored" else "projection_dim"
    return f"{found}; a larger {size} agrees better (more numbers per example)"
