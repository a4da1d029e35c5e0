"""What one poll of the GPUs yields: typed samples that serialise to plain JSON.

Every measured field is optional: None means N/A (the card or driver does not report it, or the call failed).
Units: bytes for memory, percent for utilisation and fan, degrees Celsius, watts, MHz, KiB/s for PCIe.
Traces are read back, every field checked, by `trace_fields.snapshot_from_json`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class GpuSample:
    index: int
    name: str | None = None
    uuid: str | None = None
    memory_used: int | None = None
    memory_reserved: int | None = None
    memory_total: int | None = None
    util_sm: int | None = None
    util_memory: int | None = None
    temperature: int | None = None
    power_draw: float | None = None
    power_limit: float | None = None
    clock_sm: int | None = None
    clock_memory: int | None = None
    pcie_rx: int | None = None
    pcie_tx: int | None = None
    mig_mode: bool | None = None
    fan: int | None = None
    lost: bool = False  # the driver reports the GPU as lost (fell off the bus, needs a reset)

    @property
    def memory_percent(self) -> float | None:
        if self.memory_used is None or not self.memory_total:
            return None
        return 100.0 * self.memory_used / self.memory_total

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
