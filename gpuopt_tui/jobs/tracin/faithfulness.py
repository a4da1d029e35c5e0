"""How faithful a run's scores are: the same settings and exact all-parameter TracIn on a small subset, compared
by rank (Spearman across training examples, top-10 overlap), like IG's completeness check."""

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
TOP_K = 10


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
    `options`, and with exact gradients of every parameter (method factored, unprojected, fp32), and how they
    agree."""
    sub_train = train.head(n_train)
    sub_test = test.head(MAX_TEST)
    probe = sub_test.batch([0])
    everything = select_parameters(adapter, probe, "all")
    quiet = dataclasses.replace(options, train_cache=None, keep_matrix=True, top_k=1)
    ours = tracin_scores(
        adapter, checkpoints, sub_train, sub_test, names, quiet, reporter=PrefixedReporter(reporter, AGREEMENT_RUN)
    )
    exact_options = dataclasses.replace(
        quiet, method="factored", projection_dim=0, projection_in=0, projection_out=0, precision="fp32"
    )
    exact_reporter = PrefixedReporter(reporter, AGREEMENT_EXACT)
    exact = tracin_scores(adapter, checkpoints, sub_train, sub_test, everything, exact_options, reporter=exact_reporter)
    return {
        "reference": "exact gradients of every Linear, Embedding and LayerNorm parameter, fp32",
        "excluded_from_reference": exact.stats["excluded_parameters"],
        "n_train": len(sub_train),
        "n_test": len(sub_test),
        "spearman": rank_correlation(ours.matrix, exact.matrix),
        "top_k": TOP_K,
        "top_k_overlap": top_k_overlap(ours.matrix, exact.matrix, TOP_K),
    }
