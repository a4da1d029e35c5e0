"""What a recommended batch must do when it runs for real, for the planner benchmarks that run one
(memory_planner_bench.py's closed-form and measured-run parts, planner_traced.py --recommend).

A recommendation passes when it did not run out of memory, the allocator never had to retry (a retry frees cached
blocks to make room: the run was at the edge) and its peak, torch's reserved memory plus what lies outside torch
(CUDA context, kernels), is within the budget and uses at least `LOW_SHARE` of it, unless no micro-batch the
search may choose (an exact divisor of the effective batch) could reach that share.
"""

from __future__ import annotations

from gpuopt_tui.core.planner.estimate import Overheads

LOW_SHARE = 0.80


def budget_share(footprint: int | None, limit: int) -> float | None:
    """The peak as a share of the budget (None when there is no peak: the run ran out of memory or failed)."""
    return None if footprint is None or limit <= 0 else footprint / limit


def passes(oom: bool, retries: int, share: float | None, reachable: bool = True) -> bool:
    """No out-of-memory error, no allocator retry, within the budget, and at least `LOW_SHARE` of it where a
    choosable micro-batch could reach that (`reachable`)."""
    if oom or retries or share is None or share > 1.0:
        return False
    return share >= LOW_SHARE or not reachable


def pretend_card(spare: int, margin: float, headroom: float) -> int:
    """Bytes of a card for CPU plumbing runs (--quick): `spare` bytes beyond the fixed overheads a plan counts
    (context, workspaces, allocator) once `margin` of the card is the budget and `headroom` of it is kept back,
    so that recommended batches of tiny models stay CPU-sized."""
    oh = Overheads()
    return int((oh.context + oh.workspaces + oh.allocator + spare) / margin / (1 - headroom))
