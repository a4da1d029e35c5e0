"""The GPU fields: what a sample of one GPU holds, and the one table that says how each field is written in the
CSV log, the text report (`gpuopt-tui gpu --once`), the GPU screen's detail and the dashboard's panel.

A new metric is an attribute of GpuSample and a row of GPU_FIELDS here, plus its NVML call in nvml.py; traces
and JSON follow the dataclass by themselves (trace_fields, `to_dict`).

Every measured field is optional: None means N/A (the card or driver does not report it, or the call failed).
Units: bytes for memory, percent for utilisation and fan, degrees Celsius, watts, MHz, KiB/s for PCIe.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from gpuopt_tui.core.telemetry import display


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


Text = Callable[[GpuSample], str]


@dataclass(frozen=True)
class Cell:
    """A figure as people read it: a column of the text report or the panel, or a part of a detail line."""

    title: str  # report: the column header; detail: the line ('Util'); panel: unused
    text: Text
    label: str = ""  # detail: the part's label within its line ('SM'), "" for none
    width: int = 0  # panel: the column's width in cells
    grade: Callable[[GpuSample], float | None] | None = None  # panel: the fraction its colour is graded on
    levels: tuple[float, float] = (0.7, 0.9)  # panel: grade from which it turns yellow, then red
    optional: bool = False  # detail: left out when the text is empty; panel: dropped first on a narrow line


def _mib(value: int | None) -> str:
    return display.NA if value is None else str(round(value / 2**20))


def _value(value: Any) -> str:
    if value is None:
        return display.NA
    if isinstance(value, bool):
        return "Enabled" if value else "Disabled"
    if isinstance(value, float):
        return f"{value:.2f}" if math.isfinite(value) else ""
    return str(value)


@dataclass(frozen=True)
class GpuField:
    """One attribute of GpuSample and where it shows; a figure made of several fields (memory used/total,
    power draw/limit) sits on the first of them."""

    name: str  # the GpuSample attribute
    csv: str  # the CSV log column: nvidia-smi --query-gpu style name with its unit
    csv_text: Callable[[Any], str] = _value
    report: Cell | None = None
    detail: Cell | None = None
    panel: Cell | None = None


def _power(g: GpuSample) -> str:
    return display.power(g.power_draw, g.power_limit)


def _fraction(percent: float | None) -> float | None:
    return None if percent is None else percent / 100


GPU_FIELDS: tuple[GpuField, ...] = (
    GpuField("index", "index", str),
    GpuField("name", "name"),
    GpuField("uuid", "uuid"),
    GpuField("lost", "state", lambda lost: "lost" if lost else "ok"),
    GpuField(
        "memory_used",
        "memory.used [MiB]",
        _mib,
        report=Cell("MEMORY", display.memory),
        detail=Cell("Memory", lambda g: f"{display.memory(g)} ({display.percent(g.memory_percent)})"),
        panel=Cell("", lambda g: display.memory(g, compact=True), width=12),
    ),
    GpuField(
        "memory_reserved",
        "memory.reserved [MiB]",
        _mib,
        detail=Cell(
            "Memory",
            lambda g: "" if g.memory_reserved is None else f"{display.gib(g.memory_reserved)} GiB",
            label="reserved",
            optional=True,
        ),
    ),
    GpuField("memory_total", "memory.total [MiB]", _mib),
    GpuField(
        "util_sm",
        "utilization.gpu [%]",
        report=Cell("SM", lambda g: display.percent(g.util_sm)),
        detail=Cell("Util", lambda g: display.percent(g.util_sm), label="SM"),
        panel=Cell(
            "", lambda g: display.percent(g.util_sm), width=4, grade=lambda g: _fraction(g.util_sm), levels=(0.5, 0.8)
        ),
    ),
    GpuField(
        "util_memory",
        "utilization.memory [%]",
        report=Cell("MEM", lambda g: display.percent(g.util_memory)),
        detail=Cell("Util", lambda g: display.percent(g.util_memory), label="memory"),
    ),
    GpuField(
        "temperature",
        "temperature.gpu [C]",
        report=Cell("TEMP", lambda g: display.temperature(g.temperature)),
        detail=Cell("Temp", lambda g: display.temperature(g.temperature)),
        panel=Cell(
            "",
            lambda g: display.temperature(g.temperature),
            width=4,
            grade=lambda g: _fraction(g.temperature),
            levels=(0.75, 0.85),
            optional=True,
        ),
    ),
    GpuField(
        "power_draw",
        "power.draw [W]",
        report=Cell("POWER", _power),
        detail=Cell("Power", _power),
        panel=Cell("", _power, width=10, optional=True),
    ),
    GpuField("power_limit", "power.limit [W]"),
    GpuField(
        "clock_sm",
        "clocks.sm [MHz]",
        report=Cell("SM CLK", lambda g: display.clock(g.clock_sm)),
        detail=Cell("Clocks", lambda g: display.clock(g.clock_sm), label="SM"),
    ),
    GpuField(
        "clock_memory",
        "clocks.mem [MHz]",
        report=Cell("MEM CLK", lambda g: display.clock(g.clock_memory)),
        detail=Cell("Clocks", lambda g: display.clock(g.clock_memory), label="memory"),
    ),
    GpuField(
        "pcie_rx",
        "pcie.rx [KiB/s]",
        report=Cell("PCIE RX / TX", lambda g: f"{display.rate_kib(g.pcie_rx)} / {display.rate_kib(g.pcie_tx)}"),
        detail=Cell("PCIe", lambda g: display.rate_kib(g.pcie_rx), label="rx"),
    ),
    GpuField("pcie_tx", "pcie.tx [KiB/s]", detail=Cell("PCIe", lambda g: display.rate_kib(g.pcie_tx), label="tx")),
    GpuField(
        "mig_mode",
        "mig.mode",
        report=Cell("MIG", lambda g: display.mig(g.mig_mode)),
        detail=Cell("PCIe", lambda g: display.mig(g.mig_mode), label="MIG"),
    ),
    GpuField(
        "fan",
        "fan.speed [%]",
        report=Cell("FAN", lambda g: display.percent(g.fan)),
        detail=Cell("Temp", lambda g: display.percent(g.fan), label="fan"),
    ),
)

CSV_COLUMNS: tuple[str, ...] = ("timestamp", *(f.csv for f in GPU_FIELDS))
REPORT_CELLS: tuple[Cell, ...] = tuple(f.report for f in GPU_FIELDS if f.report is not None)
PANEL_CELLS: tuple[Cell, ...] = tuple(f.panel for f in GPU_FIELDS if f.panel is not None)


def csv_row(timestamp: float, gpu: GpuSample) -> list[str]:
    """One CSV log row: the local time to the millisecond, then every field as CSV_COLUMNS names them."""
    stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(timestamp)) + f".{int(timestamp % 1 * 1000):03d}"
    return [stamp, *(f.csv_text(getattr(gpu, f.name)) for f in GPU_FIELDS)]


def detail_lines(gpu: GpuSample) -> list[str]:
    """The detail of a GPU, a line per group of figures ('Util    SM 48% · memory 20%'), in table order."""
    lines: dict[str, list[str]] = {}
    for f in GPU_FIELDS:
        cell = f.detail
        if cell is None:
            continue
        text = cell.text(gpu)
        parts = lines.setdefault(cell.title, [])
        if text or not cell.optional:
            parts.append(f"{cell.label} {text}" if cell.label else text)
    return [f"{title:<8}{' · '.join(parts)}" for title, parts in lines.items()]
