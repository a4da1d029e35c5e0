"""Where snapshots come from: live NVML, a recorded trace, or nothing (no driver / no GPU).

All sources answer `poll()` with a Snapshot and never raise for a missing GPU: "no GPU" is a snapshot with
no GPUs and a one-line `message`. Polls may come from a worker thread; NvmlSource serialises them.
"""

from __future__ import annotations

import bisect
import itertools
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

from gpuopt_tui.core.format import safe_text
from gpuopt_tui.core.telemetry.fields import GpuSample
from gpuopt_tui.core.telemetry.nvml import Nvml, NvmlUnavailable, load_binding
from gpuopt_tui.core.telemetry.procinfo import HostProcess, host_process
from gpuopt_tui.core.telemetry.replay import Trace, read_trace
from gpuopt_tui.core.telemetry.snapshot import ProcessSample, Snapshot

RunLookup = Callable[[int], "str | None"]  # pid -> id of the gpuopt-tui run it belongs to


@runtime_checkable
class TelemetrySource(Protocol):
    live: bool  # True when the processes are on this machine (signals make sense)
    label: str  # one line for a title bar: "NVML, driver 580.65.06", "replay of trace.jsonl", ...

    def poll(self) -> Snapshot: ...

    def close(self) -> None: ...


class NoGpuSource:
    """The no-driver / no-GPU state: every poll says why, in one line."""

    live = False

    def __init__(self, message: str) -> None:
        self.message = message
        self.label = "no GPU"

    def poll(self) -> Snapshot:
        return Snapshot(time=time.time(), message=self.message)

    def close(self) -> None:
        pass


class NvmlSource:
    """Live samples from NVML. NVML starts on the first poll; if it cannot, polls return the no-GPU state."""

    live = True

    def __init__(
        self,
        run_lookup: RunLookup | None = None,
        pcie_interval: float | None = 5.0,
        binding: ModuleType | None = None,
        processes: bool = True,
    ) -> None:
        self.nvml = Nvml(binding, pcie_interval=pcie_interval)
        self.run_lookup = run_lookup
        self.with_processes = processes
        self._lock = threading.Lock()
        self._hosts: dict[int, HostProcess] = {}
        self.label = "NVML"
        self.last_calls = 0  # NVML calls made by the last poll
        self.last_seconds = 0.0  # wall time of the last poll

    def start(self) -> str | None:
        """Start NVML now; the reason it cannot, or None."""
        with self._lock:
            return self._start()

    def _start(self) -> str | None:
        try:
            self.nvml.start()
        except NvmlUnavailable as error:
            self.label = "no GPU"
            return str(error)
        self.label = f"NVML, driver {self.nvml.driver_version or '?'}"
        return None

    def poll(self) -> Snapshot:
        with self._lock:
            started = time.perf_counter()
            calls = self.nvml.calls
            snapshot = self._poll()
            self.last_calls = self.nvml.calls - calls
            self.last_seconds = time.perf_counter() - started
            return snapshot

    def _poll(self) -> Snapshot:
        now = time.time()
        failure = self._start()
        if failure is not None:
            return Snapshot(time=now, message=failure)
        nvml = self.nvml
        if nvml.device_count == 0:
            return Snapshot(time=now, message="the NVIDIA driver reports no GPUs", notes=nvml.notes())
        nvml.begin_poll()
        gpus = tuple(nvml.sample(i) for i in range(nvml.device_count))
        processes = self._processes(gpus) if self.with_processes else ()
        return Snapshot(time=now, gpus=gpus, processes=processes, notes=nvml.notes())

    def _processes(self, gpus: tuple[GpuSample, ...]) -> tuple[ProcessSample, ...]:
        found: list[ProcessSample] = []
        seen: set[int] = set()
        for gpu in gpus:
            if gpu.lost:
                continue
            for pid, memory in self.nvml.processes(gpu.index) or ():
                seen.add(pid)
                host = self._host(pid)
                found.append(
                    ProcessSample(
                        pid=pid,
                        gpu_index=gpu.index,
                        gpu_memory=memory,
                        user=host.user,
                        command=host.command,
                        run_id=self._run_of(pid, host.session),
                    )
                )
        for gone in set(self._hosts) - seen:
            del self._hosts[gone]
        return tuple(found)

    def _host(self, pid: int) -> HostProcess:
        """Owner, command and session of a pid, read once while it keeps appearing. For a pid this machine
        cannot see (another PID namespace) the command is the driver's name for it."""
        host = self._hosts.get(pid)
        if host is None:
            host = host_process(pid)
            if host.command is None:
                host = replace(host, command=self.nvml.process_name(pid))
            self._hosts[pid] = host
        return host

    def _run_of(self, pid: int, session: int | None) -> str | None:
        """A run's process leads its own session, so its children (DataLoader workers, torchrun ranks)
        are matched through their session id."""
        if self.run_lookup is None:
            return None
        run = self.run_lookup(pid)
        if run is None and session is not None and session != pid:
            run = self.run_lookup(session)
        return run

    def describe(self) -> dict[str, Any]:
        """Facts about this machine's NVML for a trace header."""
        return {
            "host": socket.gethostname(),
            "driver": self.nvml.driver_version,
            "nvml": self.nvml.nvml_version,
            "binding": self.nvml.binding_version,
        }

    def close(self) -> None:
        with self._lock:
            self.nvml.shutdown()


class ReplaySource:
    """Plays a recorded trace. With `speed` (1.0 = real time) a poll returns the sample due at the time
    elapsed since the first poll; with speed None each poll returns the next sample. Loops at the end, with
    times shifted so they keep increasing."""

    live = False

    def __init__(
        self,
        trace: Trace | Path,
        speed: float | None = 1.0,
        loop: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.trace = trace if isinstance(trace, Trace) else read_trace(trace)
        self.speed = speed
        self.loop = loop
        self._clock = clock
        self._started: float | None = None
        self._step = 0
        self.label = f"replay of {safe_text(self.trace.path.name)}"
        times = [f.time for f in self.trace.snapshots]
        if all(b > a for a, b in itertools.pairwise(times)):
            self._offsets = [t - times[0] for t in times]
            # one pass, plus one sample gap before it starts again
            self._period = self._offsets[-1] + (times[1] - times[0] if len(times) > 1 else 1.0)
        else:  # the clock stood still or went back (an edited trace, a clock change): a second a sample
            self._offsets = [float(i) for i in range(len(times))]
            self._period = float(len(times))

    def poll(self) -> Snapshot:
        frames = self.trace.snapshots
        if self.speed is None:
            step, self._step = self._step, self._step + 1
        else:
            now = self._clock()
            if self._started is None:
                self._started = now
            step = self._step_at((now - self._started) * self.speed)
        passes, index = divmod(step, len(frames))
        if passes and not self.loop:
            passes, index = 0, len(frames) - 1
        frame = frames[index]
        return Snapshot(
            time=frame.time + passes * self._period,
            gpus=frame.gpus,
            processes=frame.processes,
            message=frame.message,
            notes=frame.notes,
        )

    def _step_at(self, elapsed: float) -> int:
        """Index (counting over loops) of the last sample at or before `elapsed` trace seconds."""
        passes, offset = divmod(elapsed, self._period)
        index = max(0, bisect.bisect_right(self._offsets, offset) - 1)
        return int(passes) * len(self._offsets) + index

    def close(self) -> None:
        pass


def open_source(
    replay: Path | None = None,
    *,
    speed: float | None = 1.0,
    run_lookup: RunLookup | None = None,
    pcie_interval: float | None = 5.0,
) -> TelemetrySource:
    """The source for this machine: a replayed trace if given, else NVML, else the no-GPU state when the
    binding itself is missing or shadowed. NVML is not started here (it starts on the first poll)."""
    if replay is not None:
        return ReplaySource(replay, speed=speed)
    try:
        binding = load_binding()
    except NvmlUnavailable as error:
        return NoGpuSource(str(error))
    return NvmlSource(run_lookup=run_lookup, pcie_interval=pcie_interval, binding=binding)


class CachedRunLookup:
    """A RunLookup over `active_runs()` (leader pid -> run id), re-read at most every `ttl` seconds."""

    def __init__(
        self,
        active_runs: Callable[[], Mapping[int, str]],
        ttl: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._active_runs = active_runs
        self._ttl = ttl
        self._clock = clock
        self._read_at: float | None = None
        self._runs: dict[int, str] = {}

    def __call__(self, pid: int) -> str | None:
        now = self._clock()
        if self._read_at is None or now - self._read_at >= self._ttl:
            self._runs = dict(self._active_runs())
            self._read_at = now
        return self._runs.get(pid)
