"""The GPU memory a plan is made for: detected through NVML, or given by the user."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.telemetry.nvml import Nvml, NvmlUnavailable

GiB = 1024**3


@dataclass(frozen=True)
class GpuMemory:
    total: int  # bytes a process can allocate: NVML total less the driver's reserved share
    label: str  # "NVIDIA H100 80GB HBM3 (GPU 0, NVML)" or "--gpu-memory 24"
    used: int | None = None  # bytes in use by anything when detected


def detect(index: int = 0, binding: ModuleType | None = None) -> GpuMemory | None:
    """GPU `index` through NVML, or None when there is no driver, no GPU or no such index."""
    nvml = Nvml(binding, pcie_interval=None)
    try:
        nvml.start()
    except NvmlUnavailable:
        return None
    try:
        if index >= nvml.device_count:
            return None
        sample = nvml.sample(index)
    finally:
        nvml.shutdown()
    if sample.lost or not sample.memory_total:
        return None
    total = sample.memory_total - (sample.memory_reserved or 0)
    return GpuMemory(total=total, label=f"{sample.name or 'GPU'} (GPU {index}, NVML)", used=sample.memory_used)


def resolve(gpu_memory_gb: float | None, index: int = 0, binding: ModuleType | None = None) -> GpuMemory:
    """The memory to plan for: `gpu_memory_gb` GiB when given, else the detected GPU; UserError when neither."""
    if gpu_memory_gb is not None:
        if gpu_memory_gb <= 0:
            raise UserError(f"--gpu-memory {gpu_memory_gb}: expected a positive number of GB")
        return GpuMemory(total=int(gpu_memory_gb * GiB), label=f"{gpu_memory_gb:g} GB given")
    found = detect(index, binding)
    if found is None:
        raise UserError(
            f"no GPU {index} found through NVML (no NVIDIA driver or GPU here); plan for a card anyway with "
            "--gpu-memory GB (e.g. --gpu-memory 24 for a 24 GB card, 80 for an A100/H100 80GB)"
        )
    return found
