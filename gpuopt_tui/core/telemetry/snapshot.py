"""What one poll of the GPUs yields: typed samples that serialise to plain JSON.

A GPU's sample and its fields are in `fields`; a process's measured fields are optional (None: N/A).
Traces are read back, every field checked, by `trace_fields.snapshot_from_json`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gpuopt_tui.core.telemetry.fields import GpuSample


@dataclass(frozen=True)
class ProcessSample:
    pid: int
    gpu_index: int
    gpu_memory: int | None = None  # bytes; None where the driver does not say (WDDM, some MIG setups)
    user: str | None = None  # None when the pid is not visible here (another container's PID namespace)
    command: str | None = None
    run_id: str | None = None  # the gpuopt-tui run this process belongs to, if any

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Snapshot:
    time: float  # unix time of the poll
    gpus: tuple[GpuSample, ...] = ()
    processes: tuple[ProcessSample, ...] = ()
    message: str = ""  # why there is nothing to show (no driver, no GPU); empty when all is well
    notes: tuple[str, ...] = field(default=())  # lasting warnings, e.g. functions this driver lacks

    @property
    def has_gpus(self) -> bool:
        return bool(self.gpus)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "t": round(self.time, 3),
            "gpus": [g.to_dict() for g in self.gpus],
            "processes": [p.to_dict() for p in self.processes],
        }
        if self.message:
            data["message"] = self.message
        if self.notes:
            data["notes"] = list(self.notes)
        return data
