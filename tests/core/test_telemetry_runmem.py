"""A run's torch memory (from its progress events, one per rank) beside the NVML memory of its processes."""

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
    memory = run_memory([PROGRESS], snap, "r1")
    assert (memory.torch_allocated, memory.torch_reserved, memory.torch_peak) == (5 * GIB, 6 * GIB, 7 * GIB)
    assert memory.nvml_used == 6 * GIB + 512 * 2**20 and memory.pids == (10,) and memory.gpus == (0,)
    assert memory.torch_processes == 1
    assert memory.overhead == 512 * 2**20  # the CUDA context and anything outside torch's allocator


def test_a_run_is_found_by_its_pids_too() -> None:
    snap = snapshot(
        ProcessSample(pid=10, gpu_index=1, gpu_memory=2 * GIB),
        ProcessSample(pid=11, gpu_index=0, gpu_memory=3 * GIB),
        ProcessSample(pid=12, gpu_index=0, gpu_memory=5 * GIB),
    )
    memory = run_memory([PROGRESS], snap, "r1", pids=[10, 11])
    assert memory.nvml_used == 5 * GIB and memory.pids == (10, 11) and memory.gpus == (0, 1)


def test_processes_without_their_own_torch_figures_have_no_overhead() -> None:
    snap = snapshot(
        ProcessSample(pid=10, gpu_index=0, gpu_memory=3 * GIB, run_id="r1"),
        ProcessSample(pid=11, gpu_index=1, gpu_memory=4 * GIB, run_id="r1"),
        ProcessSample(pid=12, gpu_index=1, gpu_memory=None, run_id="r1"),
    )
    memory = run_memory([PROGRESS], snap, "r1")
    assert memory.nvml_used == 7 * GIB and memory.pids == (10, 11, 12) and memory.gpus == (0, 1)
    assert memory.overhead is None  # one progress event describes one of three processes


def rank(reserved: int, allocated: int | None = None, peak: int | None = None) -> dict[str, object]:
    return {"type": "progress", "gpu_allocated": allocated, "gpu_reserved": reserved, "gpu_peak": peak}


def test_ranks_on_their_own_gpus_are_summed_with_their_overhead() -> None:
    reports = [rank(6 * GIB, 5 * GIB, 7 * GIB), rank(4 * GIB, 3 * GIB, 4 * GIB), {"type": "progress", "done": 1}]
    snap = snapshot(
        ProcessSample(pid=20, gpu_index=0, gpu_memory=6 * GIB + 300 * 2**20, run_id="r1"),
        ProcessSample(pid=21, gpu_index=1, gpu_memory=4 * GIB + 500 * 2**20, run_id="r1"),
        ProcessSample(pid=30, gpu_index=1, gpu_memory=9 * GIB, run_id="r2"),
    )
    memory = run_memory(reports, snap, "r1")
    assert (memory.torch_allocated, memory.torch_reserved, memory.torch_peak) == (8 * GIB, 10 * GIB, 11 * GIB)
    assert memory.torch_processes == 2  # the event without figures is not counted
    assert memory.nvml_used == 10 * GIB + 800 * 2**20 and memory.pids == (20, 21) and memory.gpus == (0, 1)
    assert memory.overhead == 800 * 2**20


def test_no_overhead_where_nvml_and_torch_see_different_processes() -> None:
    two_ranks = [rank(6 * GIB), rank(6 * GIB)]
    stray = snapshot(  # rank 1 also made a CUDA context on GPU 0: not in its torch figures
        ProcessSample(pid=20, gpu_index=0, gpu_memory=6 * GIB + GIB // 2, run_id="r1"),
        ProcessSample(pid=21, gpu_index=0, gpu_memory=GIB // 2, run_id="r1"),
        ProcessSample(pid=21, gpu_index=1, gpu_memory=6 * GIB + GIB // 2, run_id="r1"),
    )
    memory = run_memory(two_ranks, stray, "r1")
    assert memory.nvml_used == 13 * GIB + GIB // 2 and memory.gpus == (0, 1) and memory.overhead is None
    local_half = snapshot(ProcessSample(pid=20, gpu_index=0, gpu_memory=7 * GIB, run_id="r1"))  # rank 1 elsewhere
    memory = run_memory(two_ranks, local_half, "r1")
    assert memory.torch_reserved == 12 * GIB and memory.nvml_used == 7 * GIB and memory.overhead is None


def test_missing_figures_are_none() -> None:
    snap = snapshot(ProcessSample(pid=10, gpu_index=0, gpu_memory=None, run_id="r1"))
    memory = run_memory([{"type": "progress", "gpu_reserved": "lots", "gpu_peak": True}], snap, "r1")
    assert memory.torch_reserved is None and memory.torch_peak is None and memory.nvml_used is None
    assert memory.overhead is None and memory.torch_processes == 0
    empty = run_memory([], None, "r1")
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
    memory = run_memory([progress], source.poll(), "none", pids=[os.getpid()])
    del block
    if not memory.pids:
        pytest.skip("NVML's pids are not from this PID namespace (a container without --pid=host)")
    assert memory.pids == (os.getpid(),)
    assert memory.torch_reserved is not None and memory.torch_reserved >= GIB
    if memory.nvml_used is not None:  # some setups (MIG, containers) do not report per-process memory
        assert memory.nvml_used >= memory.torch_reserved
        assert memory.overhead is not None and 0 < memory.overhead < 4 * GIB
        print(f"\ntorch reserved {memory.torch_reserved / GIB:.2f} GiB, NVML {memory.nvml_used / GIB:.2f} GiB")
