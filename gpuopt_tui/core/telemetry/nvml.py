"""NVML through nvidia-ml-py (module `pynvml`): lazy start, one error wrapper, probes for driver differences.

Every query goes through `Nvml.call`, which turns any NVMLError into None (shown as N/A). A function that the
driver or the binding lacks is recorded once as a note; a field a card reports as NotSupported is not asked
again. A GPU that fell off the bus raises GpuIsLost, which makes its whole sample a "lost" one.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

from gpuopt_tui.core.telemetry.fields import GpuSample

_NOT_AVAILABLE = 2**64 - 1  # NVML's "value not available" for per-process memory
_PROCESS_QUERIES = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2")
_REINSTALL = "pip uninstall -y nvidia-ml-py3 py3nvml && pip install --force-reinstall nvidia-ml-py"


class NvmlUnavailable(Exception):
    """NVML cannot be used here; the message says why in one line (no driver, old binding, ...)."""


class GpuLost(Exception):
    """The driver reports a GPU as lost: it needs a reset or a reboot."""


class _FunctionMissing(Exception):
    pass


def check_binding(module: ModuleType) -> None:
    """Refuse an old binding that shadows nvidia-ml-py under the same module name."""
    if not (hasattr(module, "nvmlInitWithFlags") and hasattr(module, "_nvmlGetFunctionPointer")):
        where = getattr(module, "__file__", "?")
        raise NvmlUnavailable(
            f"the pynvml module at {where} is an old binding (nvidia-ml-py3 or py3nvml) that shadows "
            f"nvidia-ml-py; fix it with: {_REINSTALL}"
        )


def load_binding() -> ModuleType:
    """Import pynvml from nvidia-ml-py, or raise NvmlUnavailable with the reason."""
    try:
        with warnings.catch_warnings():
            # the `pynvml` wrapper package warns on import that nvidia-ml-py should be used; it re-exports it
            warnings.simplefilter("ignore", FutureWarning)
            import pynvml
    except ImportError:
        raise NvmlUnavailable("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from None
    check_binding(pynvml)
    return pynvml


def _init_failure(nv: ModuleType, error: Exception) -> str:
    known = {
        "NVMLError_LibraryNotFound": "no NVIDIA driver found (libnvidia-ml.so.1 is not installed)",
        "NVMLError_DriverNotLoaded": "the NVIDIA driver is not loaded",
        "NVMLError_NoPermission": "no permission to use NVML",
        "NVMLError_LibRmVersionMismatch": "the NVIDIA driver and its library differ in version (reboot or reload)",
    }
    for name, text in known.items():
        cls = getattr(nv, name, None)
        if cls is not None and isinstance(error, cls):
            return text
    return f"NVML could not start: {error}"


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class Nvml:
    """One NVML session. Not thread-safe on its own: NvmlSource serialises polls."""

    def __init__(
        self,
        binding: ModuleType | None = None,
        pcie_interval: float | None = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nv = binding
        self.pcie_interval = pcie_interval
        self._clock = clock
        self._started = False
        self._failure: str | None = None
        self.calls = 0  # NVML calls made so far (for the benchmark's calls-per-refresh figure)
        self.driver_version: str | None = None
        self.nvml_version: str | None = None
        self._handles: list[Any] = []
        self._static: list[tuple[str | None, str | None]] = []  # (name, uuid) per index
        self._missing: dict[str, None] = {}  # ordered set of function names this driver/binding lacks
        self._unsupported: set[tuple[Any, ...]] = set()
        self._memory_v2: bool | None = None  # None until probed
        self._process_query = 0  # index into _PROCESS_QUERIES of the first one that exists
        self._pcie: dict[int, tuple[float, int | None, int | None]] = {}
        self._pcie_budget = 1  # PCIe refreshes left in the current poll

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start NVML on first use; raises NvmlUnavailable (the same one every time) if it cannot."""
        if self._started:
            return
        if self._failure is not None:
            raise NvmlUnavailable(self._failure)
        try:
            if self._nv is None:
                self._nv = load_binding()
            nv = self._nv
            try:
                nv.nvmlInit()
            except nv.NVMLError as error:
                raise NvmlUnavailable(_init_failure(nv, error)) from None
        except NvmlUnavailable as error:
            self._failure = str(error)
            raise
        self._started = True
        self.driver_version = _text(self.call("nvmlSystemGetDriverVersion"))
        self.nvml_version = _text(self.call("nvmlSystemGetNVMLVersion"))
        count = self.call("nvmlDeviceGetCount") or 0
        for index in range(count):
            handle = self._safe_handle(index)
            self._handles.append(handle)
            if handle is None:
                self._static.append((None, None))
            else:
                self._static.append(
                    (_text(self.call("nvmlDeviceGetName", handle)), _text(self.call("nvmlDeviceGetUUID", handle)))
                )

    def _safe_handle(self, index: int) -> Any:
        try:
            return self.call("nvmlDeviceGetHandleByIndex", index)
        except GpuLost:
            return None

    def shutdown(self) -> None:
        if self._started:
            self._started = False
            self.call("nvmlShutdown")

    @property
    def device_count(self) -> int:
        return len(self._handles)

    @property
    def binding_version(self) -> str | None:
        return None if self._nv is None else _text(getattr(self._nv, "__version__", None))

    def notes(self) -> tuple[str, ...]:
        if not self._missing:
            return ()
        names = ", ".join(self._missing)
        return (
            f"NVML function(s) not found: {names}; nvidia-ml-py {self.binding_version or '?'} and driver "
            f"{self.driver_version or '?'} may not match, so those fields show N/A",
        )

    # -- the one wrapper -----------------------------------------------------------------------------------
    def _invoke(self, name: str, *args: Any, probe: bool = False) -> Any:
        """Call pynvml.<name>; GpuLost for a lost GPU, _FunctionMissing when the function does not exist."""
        nv = self._nv
        fn = getattr(nv, name, None)
        mismatch = getattr(nv, "NVMLLibraryMismatchError", ())
        try:
            if fn is None:
                raise _FunctionMissing(name)
            self.calls += 1
            return fn(*args)
        except nv.NVMLError_GpuIsLost:
            raise GpuLost(name) from None
        except (nv.NVMLError_FunctionNotFound, mismatch, _FunctionMissing):
            if not probe:
                self._missing.setdefault(name)
            raise _FunctionMissing(name) from None

    def call(self, name: str, *args: Any, device: int | None = None) -> Any:
        """pynvml.<name>(*args), or None on any NVML error. With `device`, NotSupported is remembered."""
        key = (device, name, *args[1:]) if device is not None else None
        if key is not None and key in self._unsupported:
            return None
        try:
            return self._invoke(name, *args)
        except _FunctionMissing:
            return None
        except self._nv.NVMLError_NotSupported:
            if key is not None:
                self._unsupported.add(key)
            return None
        except self._nv.NVMLError:
            return None

    # -- queries -------------------------------------------------------------------------------------------
    def begin_poll(self) -> None:
        """Mark the start of a poll of all GPUs (one PCIe refresh is allowed per poll)."""
        self._pcie_budget = 1

    def sample(self, index: int) -> GpuSample:
        name, uuid = self._static[index]
        handle = self._handles[index]
        if handle is None:
            return GpuSample(index, name, uuid, lost=True)
        try:
            return self._sample(index, handle, name, uuid)
        except GpuLost:
            return GpuSample(index, name, uuid, lost=True)

    def _sample(self, index: int, handle: Any, name: str | None, uuid: str | None) -> GpuSample:
        nv = self._nv
        used, reserved, total = self._memory(handle)
        util = self.call("nvmlDeviceGetUtilizationRates", handle, device=index)
        power = self.call("nvmlDeviceGetPowerUsage", handle, device=index)
        limit = self.call("nvmlDeviceGetEnforcedPowerLimit", handle, device=index)
        mig = self.call("nvmlDeviceGetMigMode", handle, device=index)
        rx, tx = self._pcie_throughput(index, handle)
        return GpuSample(
            index=index,
            name=name,
            uuid=uuid,
            memory_used=used,
            memory_reserved=reserved,
            memory_total=total,
            util_sm=None if util is None else int(util.gpu),
            util_memory=None if util is None else int(util.memory),
            temperature=self.call("nvmlDeviceGetTemperature", handle, nv.NVML_TEMPERATURE_GPU, device=index),
            power_draw=None if power is None else power / 1000.0,
            power_limit=None if limit is None else limit / 1000.0,
            clock_sm=self.call("nvmlDeviceGetClockInfo", handle, nv.NVML_CLOCK_SM, device=index),
            clock_memory=self.call("nvmlDeviceGetClockInfo", handle, nv.NVML_CLOCK_MEM, device=index),
            pcie_rx=rx,
            pcie_tx=tx,
            mig_mode=None if mig is None else bool(mig[0]),
            fan=self.call("nvmlDeviceGetFanSpeed", handle, device=index),
        )

    def _memory(self, handle: Any) -> tuple[int | None, int | None, int | None]:
        """Memory through the v2 call (v1 counts reserved memory as used on R510+); v1 on older drivers."""
        version = getattr(self._nv, "nvmlMemory_v2", None)
        if self._memory_v2 is not False and version is not None:
            try:
                info = self._invoke("nvmlDeviceGetMemoryInfo", handle, version, probe=True)
            except _FunctionMissing:
                self._memory_v2 = False
            except self._nv.NVMLError:
                return None, None, None
            else:
                self._memory_v2 = True
                return int(info.used), int(info.reserved), int(info.total)
        info = self.call("nvmlDeviceGetMemoryInfo", handle)
        return (None, None, None) if info is None else (int(info.used), None, int(info.total))

    def _pcie_throughput(self, index: int, handle: Any) -> tuple[int | None, int | None]:
        """PCIe rx/tx in KiB/s. The call blocks (~20 ms); refresh at most one GPU per poll, each at most
        every `pcie_interval` seconds, and serve the cached figures in between."""
        if self.pcie_interval is None:
            return None, None
        now = self._clock()
        cached = self._pcie.get(index)
        if self._pcie_budget and (cached is None or now - cached[0] >= self.pcie_interval):
            self._pcie_budget -= 1
            nv = self._nv
            rx = self.call("nvmlDeviceGetPcieThroughput", handle, nv.NVML_PCIE_UTIL_RX_BYTES, device=index)
            tx = self.call("nvmlDeviceGetPcieThroughput", handle, nv.NVML_PCIE_UTIL_TX_BYTES, device=index)
            self._pcie[index] = cached = (now, rx, tx)
        return (None, None) if cached is None else cached[1:]

    def process_name(self, pid: int) -> str | None:
        return _text(self.call("nvmlSystemGetProcessName", pid))

    def processes(self, index: int) -> list[tuple[int, int | None]] | None:
        """(pid, GPU memory in bytes or None) of compute processes on a GPU; None if the query fails.

        Probes once which versioned query the driver has (_v3 on R510+, _v2 before)."""
        handle = self._handles[index]
        if handle is None:
            return None
        while self._process_query < len(_PROCESS_QUERIES):
            name = _PROCESS_QUERIES[self._process_query]
            try:
                found = self._invoke(name, handle, probe=True)
            except _FunctionMissing:
                self._process_query += 1
                if self._process_query == len(_PROCESS_QUERIES):
                    self._missing.setdefault(" / ".join(_PROCESS_QUERIES))
                continue
            except GpuLost:
                return None
            except self._nv.NVMLError:
                return None
            return [(int(p.pid), _memory_or_none(p.usedGpuMemory)) for p in found]
        return None


def _memory_or_none(value: Any) -> int | None:
    if value is None or int(value) >= _NOT_AVAILABLE:
        return None
    return int(value)
