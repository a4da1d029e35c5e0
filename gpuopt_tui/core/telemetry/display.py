"""Short text for telemetry figures, shared by the headless command and the TUI. None prints as N/A."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuopt_tui.core.telemetry.fields import GpuSample

NA = "N/A"
GIB = 1024**3


def gib(value: int | None) -> str:
    return NA if value is None else f"{value / GIB:.1f}"


def memory(gpu: GpuSample, compact: bool = False) -> str:
    """'41.2/79.6 GiB' ('41.2/79.6G' compact), or N/A."""
    if gpu.memory_used is None or gpu.memory_total is None:
        return NA
    return f"{gib(gpu.memory_used)}/{gib(gpu.memory_total)}{'G' if compact else ' GiB'}"


def percent(value: float | None) -> str:
    return NA if value is None else f"{value:.0f}%"


def temperature(value: int | None) -> str:
    return NA if value is None else f"{value}°C"


def power(draw: float | None, limit: float | None) -> str:
    if draw is None or not math.isfinite(draw):
        return NA
    return f"{draw:.0f}/{limit:.0f}W" if limit is not None and math.isfinite(limit) else f"{draw:.0f}W"


def clock(value: int | None) -> str:
    return NA if value is None else f"{value} MHz"


def rate_kib(value: int | None) -> str:
    """A PCIe throughput given in KiB/s."""
    if value is None:
        return NA
    for unit, scale in (("GiB/s", 1024**2), ("MiB/s", 1024)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value} KiB/s"


def mig(value: bool | None) -> str:
    return NA if value is None else ("on" if value else "off")


def short_name(name: str | None) -> str:
    """A card name without the vendor prefix ('H100 80GB HBM3')."""
    if not name:
        return NA
    return name.removeprefix("NVIDIA ").strip() or name
