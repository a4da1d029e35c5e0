"""A run's own view of its GPU memory (torch figures from its progress events) beside what NVML reports.

torch's `reserved` is what its caching allocator holds; NVML's per-process figure adds the CUDA context and
anything allocated outside torch (NCCL buffers, cuBLAS workspaces), so NVML minus reserved is that overhead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuopt_tui.core.telemetry.snapshot import Snapshot


@dataclass(frozen=True)
class RunMemory:
    torch_allocated: int | None  # bytes, from the run's last progress event
    torch_reserved: int | None
    torch_peak: int | None
    nvml_used: int | None  # bytes, summed over the run's processes and GPUs; None if NVML does not say
    pids: tuple[int, ...]  # the processes counted
    gpus: tuple[int, ...]  # the GPU indices they use

    @property
    def overhead(self) -> int | None:
        """NVML's figure beyond torch's reserved pool (CUDA context, non-torch allocations). Only defined
        for one process on one GPU: torch's figures describe the reporting process's own device."""
        if self.nvml_used is None or self.torch_reserved is None or len(self.pids) != 1 or len(self.gpus) != 1:
            return None
        return self.nvml_used - self.torch_reserved


def _bytes(event: Mapping[str, Any], key: str) -> int | None:
    value = event.get(key)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def run_memory(
    progress: Mapping[str, Any] | None, snapshot: Snapshot | None, run_id: str, pid: int | None = None
) -> RunMemory:
    """Match a run to its processes in a snapshot (by run id, or by its leader pid) and pair the NVML
    memory with the torch figures (`gpu_allocated`, `gpu_reserved`, `gpu_peak`) of its progress event."""
    event = progress or {}
    mine = [
        p
        for p in (snapshot.processes if snapshot is not None else ())
        if p.run_id == run_id or (pid is not None and p.pid == pid)
    ]
    known = [p.gpu_memory for p in mine if p.gpu_memory is not None]
    return RunMemory(
        torch_allocated=_bytes(event, "gpu_allocated"),
        torch_reserved=_bytes(event, "gpu_reserved"),
        torch_peak=_bytes(event, "gpu_peak"),
        nvml_used=sum(known) if known else None,
        pids=tuple(sorted({p.pid for p in mine})),
        gpus=tuple(sorted({p.gpu_index for p in mine})),
    )
