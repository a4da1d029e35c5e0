"""TracIn training-data influence (TracInCP over checkpoints), usable as a library::

    from gpuopt_tui.jobs.tracin import TracInOptions, select_parameters, tracin_scores
    names = select_parameters(adapter, batch, "last", n_last=2)
    result = tracin_scores(adapter, checkpoints, train, test, names, TracInOptions(top_k=5))
    result.proponents.rows, result.self_influence, result.matrix

`run_job` in job.py is the run kind built on it.
"""

from gpuopt_tui.jobs.tracin.agreement import rank_correlation
from gpuopt_tui.jobs.tracin.checkpoints import resolve_checkpoints
from gpuopt_tui.jobs.tracin.filters import FILTERS, PairFilter, get_filter
from gpuopt_tui.jobs.tracin.grads import GradFeatures, GradientComputer
from gpuopt_tui.jobs.tracin.interface import InfluenceResult, Reporter, TopK, TracInOptions
from gpuopt_tui.jobs.tracin.params import modules_in_call_order, select_parameters
from gpuopt_tui.jobs.tracin.project import Projector
from gpuopt_tui.jobs.tracin.scores import self_influence, tracin_scores
from gpuopt_tui.jobs.tracin.shards import MemoryStore

__all__ = [
    "FILTERS",
    "GradFeatures",
    "GradientComputer",
    "InfluenceResult",
    "MemoryStore",
    "PairFilter",
    "Projector",
    "Reporter",
    "TopK",
    "TracInOptions",
    "get_filter",
    "modules_in_call_order",
    "rank_correlation",
    "resolve_checkpoints",
    "select_parameters",
    "self_influence",
    "tracin_scores",
]
