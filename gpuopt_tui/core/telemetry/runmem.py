"""A run's own view of its GPU memory (torch figures from its progress events) beside what NVML reports.

torch's `reserved` is what its caching allocator holds; NVML's per-process figure adds the CUDA context and
anything allocated outside torch (NCCL buffers, cuBLAS workspaces), so NVML minus reserved is that overhead.
A run over several processes has a progress event per rank, each about that rank's own GPU: the figures are
summed over them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuopt_tui.core.telemetry.snapshot import Snapshot

TORCH_FIELDS = ("gpu_allocated", "gpu_reserved", "gpu_peak")


@dataclass(frozen=True)
class RunMemory:
    torch_allocated: int | None  # bytes, summed over the progress events that report it; None if none does
    torch_reserved: int | None
    torch_peak: int | None  # the sum of each process's own peak
    torch_processes: int  # the progress events (a process, on a GPU of its own, each) with torch figures
    nvml_used: int | None  # bytes, summed over the run's processes and GPUs; None if NVML does not say
    pids: tuple[int, ...]  # the processes counted
    gpus: tuple[int, ...]  # the GPU indices they use
    one_gpu_each: bool  # NVML saw each of these processes on one GPU only

    @property
    def overhead(self) -> int | None:
        """NVML's figure beyond torch's reserved pools (CUDA contexts, non-torch allocations). Only defined
        where NVML saw exactly the processes whose torch figures are summed, each on one GPU: torch's figures
        describe the reporting process's own device."""
        if self.nvml_used is None or self.torch_reserved is None or not self.pids:
            return None
        if not self.one_gpu_each or len(self.pids) != self.torch_processes:
            return None
        return self.nvml_used - self.torch_reserved


def _bytes(event: Mapping[str, Any], key: str) -> int | None:
    value = event.get(key)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _sum(values: Iterable[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def run_memory(
    reports: Iterable[Mapping[str, Any]], snapshot: Snapshot | None, run_id: str, pids: Iterable[int] = ()
) -> RunMemory:
    """Match a run to its processes in a snapshot (by run id, or by one of its `pids`) and pair the NVML
    memory with the torch figures (`gpu_allocated`, `gpu_reserved`, `gpu_peak`) of its latest progress
    events (`reports`: one for a run of one process, one per rank for a run over several)."""
    events = [e for e in reports if any(_bytes(e, key) is not None for key in TORCH_FIELDS)]
    allocated, reserved, peak = (_sum(_bytes(e, key) for e in events) for key in TORCH_FIELDS)
    wanted = set(pids)
    mine = [p for p in (snapshot.processes if snapshot is not None else ()) if p.run_id == run_id or p.pid in wanted]
    used = _sum(p.gpu_memory for p in mine)
    procs = tuple(sorted({p.pid for p in mine}))
    return RunMemory(
        torch_allocated=allocated,
        torch_reserved=reserved,
        torch_peak=peak,
        torch_processes=len(events),
        nvml_used=used,
        pids=procs,
        gpus=tuple(sorted({p.gpu_index for p in mine})),
        one_gpu_each=len({(p.pid, p.gpu_index) for p in mine}) == len(procs),
    )
