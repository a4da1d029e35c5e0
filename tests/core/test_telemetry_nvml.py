"""The NVML layer against a fake driver built on the real binding's error classes, plus real NVML when present.

The fake stands in for the driver only: every call goes through the same pynvml function names, and failures
are raised as the real `pynvml.NVMLError` subclasses, so the error handling under test is the real one.
"""

from __future__ import annotations

import argparse
import os
import pwd
import subprocess
import sys
import time
import types
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml as real
import pytest

from gpuopt_tui.commands import gpu as gpu_command
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.telemetry import CachedRunLookup, NoGpuSource, NvmlSource, open_source, read_trace
from gpuopt_tui.core.telemetry.nvml import Nvml, NvmlUnavailable, check_binding

GIB = 1024**3


@dataclass
class FakeCard:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-fake-0"
    used: int = 30 * GIB
    reserved: int = GIB // 2
    total: int = 80 * GIB
    util: tuple[int, int] = (97, 41)
    temperature: int = 61
    power_mw: int = 312_500
    limit_mw: int = 700_000
    clocks: tuple[int, int] = (1980, 2619)  # SM, memory
    pcie_kib: tuple[int, int] = (1200, 48_000)  # rx, tx
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)
    lost: bool = False
    lost_at_start: bool = False


def _error(code: int) -> Exception:
    return real.NVMLError(code)


class FakeDriver(types.ModuleType):
    """A pynvml look-alike. `driver_lacks`: C functions the driver does not export (FunctionNotFound);
    `binding_lacks`: Python functions an older nvidia-ml-py does not have."""

    def __init__(
        self,
        cards: list[FakeCard],
        driver_lacks: set[str] | frozenset[str] = frozenset(),
        binding_lacks: set[str] | frozenset[str] = frozenset(),
        init_error: int | None = None,
        process_names: dict[int, str] | None = None,
    ) -> None:
        super().__init__("pynvml")
        for name in dir(real):
            if name.startswith(("NVMLError", "NVML_")) or name in ("NVMLLibraryMismatchError", "nvmlMemory_v2"):
                setattr(self, name, getattr(real, name))
        self.cards = cards
        self.driver_lacks = set(driver_lacks)
        self.init_error = init_error
        self.process_names = process_names or {}
        self.calls: Counter[str] = Counter()
        self.__version__ = "13.615.71"
        for name in binding_lacks:
            setattr(self, name, None)

    def _card(self, name: str, card: FakeCard) -> FakeCard:
        self.calls[name] += 1
        if name in self.driver_lacks:
            raise _error(real.NVML_ERROR_FUNCTION_NOT_FOUND)
        if card.lost:
            raise _error(real.NVML_ERROR_GPU_IS_LOST)
        if name in card.unsupported:
            raise _error(real.NVML_ERROR_NOT_SUPPORTED)
        return card

    # the binding's markers of a current nvidia-ml-py
    def nvmlInitWithFlags(self, flags: int) -> None:
        self.nvmlInit()

    def _nvmlGetFunctionPointer(self, name: str) -> None:
        raise AssertionError("not used")

    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise _error(self.init_error)

    def nvmlShutdown(self) -> None:
        self.calls["nvmlShutdown"] += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "580.65.06"

    def nvmlSystemGetNVMLVersion(self) -> str:
        return "13.580.65.06"

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        if pid not in self.process_names:
            raise _error(real.NVML_ERROR_NOT_FOUND)
        return self.process_names[pid]

    def nvmlDeviceGetCount(self) -> int:
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeCard:
        card = self.cards[index]
        if card.lost_at_start:
            raise _error(real.NVML_ERROR_GPU_IS_LOST)
        return card

    def nvmlDeviceGetName(self, card: FakeCard) -> str:
        return self._card("nvmlDeviceGetName", card).name

    def nvmlDeviceGetUUID(self, card: FakeCard) -> str:
        return self._card("nvmlDeviceGetUUID", card).uuid

    def nvmlDeviceGetMemoryInfo(self, card: FakeCard, version: int | None = None) -> SimpleNamespace:
        if version:
            c = self._card("nvmlDeviceGetMemoryInfo_v2", card)
            return SimpleNamespace(total=c.total, reserved=c.reserved, used=c.used, free=c.total - c.used)
        c = self._card("nvmlDeviceGetMemoryInfo", card)
        return SimpleNamespace(total=c.total, used=c.used + c.reserved, free=c.total - c.used - c.reserved)

    def nvmlDeviceGetUtilizationRates(self, card: FakeCard) -> SimpleNamespace:
        c = self._card("nvmlDeviceGetUtilizationRates", card)
        return SimpleNamespace(gpu=c.util[0], memory=c.util[1])

    def nvmlDeviceGetTemperature(self, card: FakeCard, sensor: int) -> int:
        assert sensor == real.NVML_TEMPERATURE_GPU
        return self._card("nvmlDeviceGetTemperature", card).temperature

    def nvmlDeviceGetPowerUsage(self, card: FakeCard) -> int:
        return self._card("nvmlDeviceGetPowerUsage", card).power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, card: FakeCard) -> int:
        return self._card("nvmlDeviceGetEnforcedPowerLimit", card).limit_mw

    def nvmlDeviceGetClockInfo(self, card: FakeCard, kind: int) -> int:
        c = self._card("nvmlDeviceGetClockInfo", card)
        return c.clocks[0] if kind == real.NVML_CLOCK_SM else c.clocks[1]

    def nvmlDeviceGetPcieThroughput(self, card: FakeCard, counter: int) -> int:
        c = self._card("nvmlDeviceGetPcieThroughput", card)
        return c.pcie_kib[0] if counter == real.NVML_PCIE_UTIL_RX_BYTES else c.pcie_kib[1]

    def nvmlDeviceGetMigMode(self, card: FakeCard) -> list[int]:
        self._card("nvmlDeviceGetMigMode", card)
        return [0, 0]

    def nvmlDeviceGetFanSpeed(self, card: FakeCard) -> int:
        self._card("nvmlDeviceGetFanSpeed", card)
        return 30

    def _processes(self, name: str, card: FakeCard) -> list[SimpleNamespace]:
        c = self._card(name, card)
        na = real.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
        return [SimpleNamespace(pid=pid, usedGpuMemory=na if mem is None else mem) for pid, mem in c.processes]

    def nvmlDeviceGetComputeRunningProcesses_v3(self, card: FakeCard) -> list[SimpleNamespace]:
        return self._processes("nvmlDeviceGetComputeRunningProcesses_v3", card)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, card: FakeCard) -> list[SimpleNamespace]:
        return self._processes("nvmlDeviceGetComputeRunningProcesses_v2", card)


def source_for(driver: FakeDriver, **kwargs: Any) -> NvmlSource:
    return NvmlSource(binding=driver, **kwargs)


# --- fields ---------------------------------------------------------------------------------------------------


def test_every_field_is_read_and_memory_comes_from_the_v2_call() -> None:
    driver = FakeDriver([FakeCard()])
    snapshot = source_for(driver).poll()
    assert snapshot.message == "" and snapshot.notes == ()
    gpu = snapshot.gpus[0]
    assert (gpu.index, gpu.name, gpu.uuid) == (0, "NVIDIA H100 80GB HBM3", "GPU-fake-0")
    # v2 reports used without the reserved part; v1 would have added it
    assert (gpu.memory_used, gpu.memory_reserved, gpu.memory_total) == (30 * GIB, GIB // 2, 80 * GIB)
    assert driver.calls["nvmlDeviceGetMemoryInfo_v2"] == 1 and driver.calls["nvmlDeviceGetMemoryInfo"] == 0
    assert (gpu.util_sm, gpu.util_memory, gpu.temperature) == (97, 41, 61)
    assert (gpu.power_draw, gpu.power_limit) == (312.5, 700.0)  # milliwatts to watts
    assert (gpu.clock_sm, gpu.clock_memory, gpu.pcie_rx, gpu.pcie_tx) == (1980, 2619, 1200, 48_000)
    assert (gpu.mig_mode, gpu.fan, gpu.lost) == (False, 30, False)


def test_unsupported_fields_are_na_and_not_asked_again() -> None:
    card = FakeCard(unsupported={"nvmlDeviceGetFanSpeed", "nvmlDeviceGetMigMode", "nvmlDeviceGetPcieThroughput"})
    driver = FakeDriver([card])
    source = source_for(driver, pcie_interval=0.0)
    for _ in range(3):
        gpu = source.poll().gpus[0]
        assert (gpu.fan, gpu.mig_mode, gpu.pcie_rx, gpu.pcie_tx) == (None, None, None, None)
        assert gpu.temperature == 61
    assert driver.calls["nvmlDeviceGetFanSpeed"] == 1
    assert driver.calls["nvmlDeviceGetMigMode"] == 1
    assert driver.calls["nvmlDeviceGetPcieThroughput"] == 2  # rx and tx, once each
    assert driver.calls["nvmlDeviceGetTemperature"] == 3


def test_a_function_the_driver_lacks_is_na_and_reported_once() -> None:
    driver = FakeDriver([FakeCard(), FakeCard(uuid="GPU-fake-1")], driver_lacks={"nvmlDeviceGetEnforcedPowerLimit"})
    source = source_for(driver)
    for _ in range(3):
        snapshot = source.poll()
    assert [g.power_limit for g in snapshot.gpus] == [None, None]
    assert [g.power_draw for g in snapshot.gpus] == [312.5, 312.5]
    assert len(snapshot.notes) == 1
    assert snapshot.notes[0].count("nvmlDeviceGetEnforcedPowerLimit") == 1
    assert "580.65.06" in snapshot.notes[0] and "13.615.71" in snapshot.notes[0]


def test_a_function_the_binding_lacks_is_na_and_reported() -> None:
    driver = FakeDriver([FakeCard()], binding_lacks={"nvmlDeviceGetMigMode"})
    snapshot = source_for(driver).poll()
    assert snapshot.gpus[0].mig_mode is None
    assert "nvmlDeviceGetMigMode" in snapshot.notes[0]


def test_memory_falls_back_to_the_v1_call_on_a_driver_without_v2() -> None:
    driver = FakeDriver([FakeCard()], driver_lacks={"nvmlDeviceGetMemoryInfo_v2"})
    source = source_for(driver)
    source.poll()
    gpu = source.poll().gpus[0]
    assert (gpu.memory_used, gpu.memory_reserved, gpu.memory_total) == (30 * GIB + GIB // 2, None, 80 * GIB)
    assert driver.calls["nvmlDeviceGetMemoryInfo_v2"] == 1  # probed once
    assert source.poll().notes == ()  # an older driver is not a mismatch


# --- processes ------------------------------------------------------------------------------------------------


def test_process_query_uses_v3_when_the_driver_has_it() -> None:
    driver = FakeDriver([FakeCard(processes=[(os.getpid(), 3 * GIB)])])
    source = source_for(driver)
    source.poll()
    source.poll()
    assert driver.calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 2
    assert driver.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 0


@pytest.mark.parametrize("where", ["driver", "binding"])
def test_process_query_falls_back_to_v2_once(where: str) -> None:
    lacks = {"nvmlDeviceGetComputeRunningProcesses_v3"}
    kwargs = {"driver_lacks": lacks} if where == "driver" else {"binding_lacks": lacks}
    driver = FakeDriver([FakeCard(processes=[(os.getpid(), 3 * GIB)])], **kwargs)
    source = source_for(driver)
    for _ in range(3):
        snapshot = source.poll()
    assert [(p.pid, p.gpu_memory) for p in snapshot.processes] == [(os.getpid(), 3 * GIB)]
    assert driver.calls["nvmlDeviceGetComputeRunningProcesses_v3"] == (1 if where == "driver" else 0)
    assert driver.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 3
    assert snapshot.notes == ()


def test_no_process_query_at_all_is_reported() -> None:
    lacks = {"nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"}
    driver = FakeDriver([FakeCard(processes=[(1, GIB)])], driver_lacks=lacks)
    snapshot = source_for(driver).poll()
    assert snapshot.processes == ()
    assert snapshot.gpus[0].memory_used == 30 * GIB
    assert "nvmlDeviceGetComputeRunningProcesses_v3" in snapshot.notes[0]


def test_processes_carry_owner_command_and_run_through_the_session() -> None:
    # a run's process leads its own session; its child (a DataLoader worker, a rank) is matched via the session
    leader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, time; p = subprocess.Popen(['sleep', '30']); print(p.pid, flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert leader.stdout is not None
        child = int(leader.stdout.readline())
        deadline = time.monotonic() + 5
        while not Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"sleep") and time.monotonic() < deadline:
            time.sleep(0.01)  # the child may not have exec'd yet
        hidden = 2**22 + 17  # above Linux's pid_max: a pid from another PID namespace
        card = FakeCard(processes=[(leader.pid, GIB), (child, 2 * GIB), (os.getpid(), None), (hidden, GIB)])
        driver = FakeDriver([card], process_names={hidden: "/usr/bin/python3"})
        source = source_for(driver, run_lookup={leader.pid: "run-1"}.get)
        by_pid = {p.pid: p for p in source.poll().processes}
    finally:
        os.killpg(leader.pid, 15)
        leader.wait()
    assert by_pid[leader.pid].run_id == "run-1" and by_pid[child].run_id == "run-1"
    assert by_pid[child].command == "sleep 30"
    me = by_pid[os.getpid()]
    assert me.run_id is None and me.gpu_memory is None  # NVML's "not available" value
    assert me.user == pwd.getpwuid(os.getuid()).pw_name
    assert by_pid[hidden].user is None and by_pid[hidden].command == "/usr/bin/python3"


# --- lost GPUs, no driver, old bindings -------------------------------------------------------------------------


def test_a_gpu_lost_while_polling_becomes_a_lost_row() -> None:
    cards = [FakeCard(processes=[(os.getpid(), GIB)]), FakeCard(uuid="GPU-fake-1", processes=[(os.getpid(), GIB)])]
    driver = FakeDriver(cards)
    source = source_for(driver)
    assert not any(g.lost for g in source.poll().gpus)
    cards[1].lost = True
    snapshot = source.poll()
    ok, lost = snapshot.gpus
    assert not ok.lost and ok.memory_used == 30 * GIB
    assert lost.lost and (lost.name, lost.uuid) == ("NVIDIA H100 80GB HBM3", "GPU-fake-1")
    assert lost.memory_used is None and lost.util_sm is None
    assert [p.gpu_index for p in snapshot.processes] == [0]


def test_a_gpu_lost_before_start_is_a_lost_row() -> None:
    driver = FakeDriver([FakeCard(), FakeCard(lost_at_start=True)])
    gpus = source_for(driver).poll().gpus
    assert [g.lost for g in gpus] == [False, True]
    assert gpus[1].name is None


@pytest.mark.parametrize(
    ("code", "text"),
    [
        (real.NVML_ERROR_LIBRARY_NOT_FOUND, "no NVIDIA driver found"),
        (real.NVML_ERROR_DRIVER_NOT_LOADED, "driver is not loaded"),
        (real.NVML_ERROR_NO_PERMISSION, "no permission"),
        (real.NVML_ERROR_UNKNOWN, "NVML could not start"),
    ],
)
def test_nvml_that_cannot_start_is_the_no_gpu_state(code: int, text: str) -> None:
    driver = FakeDriver([FakeCard()], init_error=code)
    source = source_for(driver)
    first, second = source.poll(), source.poll()
    assert first.gpus == () and text in first.message and second.message == first.message
    assert driver.calls["nvmlInit"] == 1  # the failure is remembered, not retried every poll
    assert source.label == "no GPU"


def test_a_driver_without_gpus_says_so() -> None:
    snapshot = source_for(FakeDriver([])).poll()
    assert snapshot.gpus == () and "no GPUs" in snapshot.message


def test_this_machine_without_a_driver_gives_one_clear_line() -> None:
    source = open_source()
    snapshot = source.poll()
    if snapshot.has_gpus:
        pytest.skip("this machine has an NVIDIA driver")
    assert snapshot.message and "\n" not in snapshot.message
    assert "NVIDIA driver" in snapshot.message or "NVML" in snapshot.message


def test_an_old_binding_shadowing_nvidia_ml_py_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    old = types.ModuleType("pynvml")
    old.__file__ = "/site-packages/pynvml.py"
    old.nvmlInit = lambda: None  # nvidia-ml-py3 7.352 has nvmlInit but neither marker below
    with pytest.raises(NvmlUnavailable, match="nvidia-ml-py3 or py3nvml"):
        check_binding(old)
    monkeypatch.setitem(sys.modules, "pynvml", old)
    source = open_source()
    assert isinstance(source, NoGpuSource)
    message = source.poll().message
    assert "/site-packages/pynvml.py" in message and "pip install --force-reinstall nvidia-ml-py" in message


# --- PCIe and cost -------------------------------------------------------------------------------------------


def test_pcie_throughput_is_refreshed_rarely_one_gpu_per_poll() -> None:
    now = [0.0]
    driver = FakeDriver([FakeCard(), FakeCard(uuid="GPU-fake-1", pcie_kib=(7, 9))])
    nvml = Nvml(driver, pcie_interval=5.0, clock=lambda: now[0])
    nvml.start()
    seen = []
    for t in range(12):
        now[0] = float(t)
        nvml.begin_poll()
        seen.append((nvml.sample(0).pcie_rx, nvml.sample(1).pcie_rx, driver.calls["nvmlDeviceGetPcieThroughput"]))
    # t=0: GPU 0 refreshed, GPU 1 waits; t=1: GPU 1; again at t=5 and t=6, t=10 and t=11 (2 calls each: rx, tx)
    assert seen[0] == (1200, None, 2) and seen[1] == (1200, 7, 4)
    assert [calls for *_, calls in seen] == [2, 4, 4, 4, 4, 6, 8, 8, 8, 8, 10, 12]


def test_pcie_can_be_turned_off() -> None:
    driver = FakeDriver([FakeCard()])
    gpu = source_for(driver, pcie_interval=None).poll().gpus[0]
    assert gpu.pcie_rx is None and driver.calls["nvmlDeviceGetPcieThroughput"] == 0


def test_a_poll_reports_its_nvml_calls() -> None:
    driver = FakeDriver([FakeCard(processes=[(os.getpid(), GIB)])], binding_lacks=set())
    source = source_for(driver, pcie_interval=None)
    source.poll()
    before = sum(driver.calls.values())
    source.poll()
    assert source.last_calls == sum(driver.calls.values()) - before == 10
    assert source.last_seconds > 0


# --- recording ------------------------------------------------------------------------------------------------


def parse_record(path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gpu_command.configure(parser)
    return parser.parse_args(["--record", str(path), "--interval", "0.25", "--duration", "0.6", *extra])


def test_record_writes_nvml_samples_as_a_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver = FakeDriver([FakeCard(processes=[(os.getpid(), GIB)])])
    monkeypatch.setattr(gpu_command, "open_source", lambda *a, **k: NvmlSource(binding=driver))
    out = tmp_path / "trace.jsonl"
    args = parse_record(out)
    assert gpu_command.run(args) == 0
    trace = read_trace(out)
    assert len(trace.snapshots) == 3  # at 0, 0.25 and 0.5 s
    assert trace.header["driver"] == "580.65.06" and trace.header["interval"] == 0.25
    assert trace.snapshots[0].gpus[0].memory_used == 30 * GIB
    assert trace.snapshots[-1].processes[0].pid == os.getpid()
    assert 0.4 <= trace.duration <= 0.7
    with pytest.raises(UserError, match="already exists"):
        gpu_command.run(args)  # a trace is never overwritten
    shared = tmp_path / "shared.jsonl"
    assert gpu_command.run(parse_record(shared, "--redact")) == 0
    redacted = read_trace(shared)
    assert redacted.header["host"] == "redacted" and redacted.snapshots[0].processes[0].user == "user1"


@pytest.mark.gpu
def test_real_nvml_on_this_machine() -> None:
    source = NvmlSource()
    failure = source.start()
    if failure:
        pytest.skip(f"no NVML here: {failure}")
    source.poll()
    snapshot = source.poll()
    assert snapshot.message == ""
    for gpu in snapshot.gpus:
        assert gpu.name and gpu.uuid and not gpu.lost
        assert gpu.memory_total and 0 <= gpu.memory_used <= gpu.memory_total
        assert gpu.util_sm is None or 0 <= gpu.util_sm <= 100
        assert gpu.temperature is None or 0 < gpu.temperature < 120
        assert gpu.power_draw is None or gpu.power_limit is None or 0 < gpu.power_draw <= 1.5 * gpu.power_limit
    print(
        f"\n{len(snapshot.gpus)} GPU(s), {source.label}: {source.last_calls} NVML calls, {source.last_seconds * 1e3:.2f} ms"
    )
    print("notes:", snapshot.notes or "none")


def test_the_run_lookup_rereads_the_active_runs_after_its_ttl() -> None:
    now = [0.0]
    reads: list[int] = []

    def active_runs() -> dict[int, str]:
        reads.append(1)
        return {10: "r1"} if len(reads) == 1 else {11: "r2"}

    lookup = CachedRunLookup(active_runs, ttl=5.0, clock=lambda: now[0])
    assert (lookup(10), lookup(11), len(reads)) == ("r1", None, 1)
    now[0] = 4.9
    assert (lookup(10), len(reads)) == ("r1", 1)
    now[0] = 5.0
    assert (lookup(10), lookup(11), len(reads)) == (None, "r2", 2)
