"""A run's torch memory (from its progress events) beside the NVML memory of its processes."""

from __future__ import annotations

import os

import pytest

from gpuopt_tui.core.telemetry import GpuSample, NvmlSource, ProcessSample, Snapshot, run_memory

GIB = 1024**3


def snapshot(*processes: ProcessSample) -> Snapshot:
    return Snapshot(time=1.0, gpus=(GpuSample(index=0), GpuSample(index=1)), processes=processes)


PROGRESS = {
    "type": "progress",
    "done": 3,
    "total": 10,
    "gpu_allocated": 5 * GIB,
    "gpu_reserved": 6 * GIB,
    "gpu_peak": 7 * GIB,
}


def test_one_process_on_one_gpu_gives_the_overhead() -> None:
    snap = snapshot(
        ProcessSample(pid=10, gpu_index=0, gpu_memory=6 * GIB + 512 * 2**20, run_id="r1"),
        ProcessSample(pid=99, gpu_index=0, gpu_memory=GIB, run_id=None),
    )
    memory = run_memory(PROGRESS, snap, "r1")
    assert (memory.torch_allocated, memory.torch_reserved, memory.torch_peak) == (5 * GIB, 6 * GIB, 7 * GIB)
    assert memory.nvml_used == 6 * GIB + 512 * 2**20 and memory.pids == (10,) and memory.gpus == (0,)
    assert memory.overhead == 512 * 2**20  # the CUDA context and anything outside torch's allocator


def test_a_run_is_found_by_its_leader_pid_too() -> None:
    snap = snapshot(ProcessSample(pid=10, gpu_index=1, gpu_memory=2 * GIB))
    memory = run_memory(PROGRESS, snap, "r1", pid=10)
    assert memory.nvml_used == 2 * GIB and memory.gpus == (1,)


def test_several_processes_are_summed_without_an_overhead() -> None:
    snap = snapshot(
        ProcessSample(pid=10, gpu_index=0, gpu_memory=3 * GIB, run_id="r1"),
        ProcessSample(pid=11, gpu_index=1, gpu_memory=4 * GIB, run_id="r1"),
        ProcessSample(pid=12, gpu_index=1, gpu_memory=None, run_id="r1"),
    )
    memory = run_memory(PROGRESS, snap, "r1")
    assert memory.nvml_used == 7 * GIB and memory.pids == (10, 11, 12) and memory.gpus == (0, 1)
    assert memory.overhead is None  # torch's figures describe one process on one device


def test_missing_figures_are_none() -> None:
    snap = snapshot(ProcessSample(pid=10, gpu_index=0, gpu_memory=None, run_id="r1"))
    memory = run_memory({"type": "progress", "gpu_reserved": "lots", "gpu_peak": True}, snap, "r1")
    assert memory.torch_reserved is None and memory.torch_peak is None and memory.nvml_used is None
    assert memory.overhead is None
    empty = run_memory(None, None, "r1")
    assert empty.pids == () and empty.nvml_used is None and empty.torch_allocated is None


@pytest.mark.gpu
def test_torch_memory_beside_nvml_on_a_real_gpu() -> None:
    source = NvmlSource()
    if source.start():
        pytest.skip("no NVML")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    block = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    progress = {
        "gpu_allocated": torch.cuda.memory_allocated(),
        "gpu_reserved": torch.cuda.memory_reserved(),
        "gpu_peak": torch.cuda.max_memory_allocated(),
    }
    memory = run_memory(progress, source.poll(), "none", pid=os.getpid())
    del block
    if not memory.pids:
        pytest.skip("NVML's pids are not from this PID namespace (a container without --pid=host)")
    assert memory.pids == (os.getpid(),)
    assert memory.torch_reserved is not None and memory.torch_reserved >= GIB
    if memory.nvml_used is not None:  # some setups (MIG, containers) do not report per-process memory
        assert memory.nvml_used >= memory.torch_reserved
        assert memory.overhead is not None and 0 < memory.overhead < 4 * GIB
        print(f"\ntorch reserved {memory.torch_reserved / GIB:.2f} GiB, NVML {memory.nvml_used / GIB:.2f} GiB")
