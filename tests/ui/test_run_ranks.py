"""A run over several processes (torchrun ranks) in the TUI: its rank count wherever its progress shows, a row per
rank in the runs screen, memory summed over its GPUs, and its workers' GPU processes marked with the run."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from rich.text import Text

from gpuopt_tui.app import make_app
from gpuopt_tui.core.runs.events import EventWriter
from gpuopt_tui.core.telemetry import CachedRunLookup, GpuSample, ProcessSample, RunLookup, Snapshot
from gpuopt_tui.ui.gpu_telemetry import GpuTelemetry
from gpuopt_tui.ui.widgets.gpu_view import ProcessList, process_text, run_label
from gpuopt_tui.ui.widgets.rank_table import RankTable
from gpuopt_tui.ui.widgets.runs_table import RunsTable

from .conftest import make_run, wait_for, widget_text

GIB = 1024**3
MIB = 2**20
WORKERS = (2**22 + 1, 2**22 + 2)  # pids above Linux's pid_max: no process of this machine has them


def rank_events(run_dir: Path, host: str, *reports: tuple[int, int, int]) -> None:
    """What torchrun's workers write: `rank_started`, then progress (rank, done, total) with their own GPU memory."""
    for rank, pid in enumerate(WORKERS):
        writer = EventWriter(run_dir / "events.jsonl", rank=rank)
        writer.emit("rank_started", host=host, pid=pid, start_time=None, device=f"cuda:{rank}")
        writer.close()
    for rank, done, total in reports:
        writer = EventWriter(run_dir / "events.jsonl", rank=rank)
        memory = {"gpu_allocated": (rank + 1) * GIB, "gpu_reserved": (rank + 2) * GIB, "gpu_peak": (rank + 2) * GIB}
        writer.progress(force=True, done=done, total=total, unit="samples", rate=2.5, eta=4.0, **memory)
        writer.close()


def rank_event(run_dir: Path, rank: int, type: str, **fields: object) -> None:
    writer = EventWriter(run_dir / "events.jsonl", rank=rank)
    writer.emit(type, host=socket.gethostname(), **fields)
    writer.close()


def rows(app: object) -> list[list[str]]:
    table = app.screen.query_one("#detail-ranks", RankTable)  # type: ignore[attr-defined]
    return [[c.plain if isinstance(c, Text) else str(c) for c in table.get_row(key)] for key in ("0", "1")]


class WorkerGpus:
    """Live NVML as it would see the run's two workers, one on each GPU: each holds its torch pool plus 256 MiB.
    Processes are tagged through `lookup`, as NvmlSource does with the app's run lookup."""

    live = True
    label = "test"

    def __init__(self) -> None:
        self.lookup: RunLookup | None = None

    def poll(self) -> Snapshot:
        gpus = tuple(GpuSample(index=i, name="card", memory_used=10 * GIB, memory_total=80 * GIB) for i in (0, 1))
        processes = tuple(
            ProcessSample(
                pid=pid,
                gpu_index=rank,
                gpu_memory=(rank + 2) * GIB + 256 * MIB,
                user="me",
                command="python -m gpuopt_tui.jobs.worker",
                run_id=self.lookup(pid) if self.lookup else None,
            )
            for rank, pid in enumerate(WORKERS)
        )
        return Snapshot(time=time.time(), gpus=gpus, processes=processes)

    def close(self) -> None:
        pass


async def test_a_running_run_shows_its_ranks_their_memory_and_their_gpu_processes(
    live_run: tuple[Path, subprocess.Popen[bytes]],
) -> None:
    run_dir, _ = live_run
    rank_events(run_dir, socket.gethostname(), (0, 4, 10), (1, 6, 10))
    source = WorkerGpus()
    app = make_app(screen="runs", telemetry=GpuTelemetry(source))
    source.lookup = CachedRunLookup(app.active_run_pids, ttl=0.0)
    async with app.run_test(size=(120, 40)) as pilot:
        nvml = "GPU memory (NVML): 5.5 GiB on 2 GPUs (0,1) · 2 processes · 512.0 MiB outside torch's pools"
        await wait_for(pilot, lambda: nvml in widget_text(app, "#detail-progress"))
        progress = widget_text(app, "#detail-progress")
        assert "10/20 samples" in progress and "rate 5.00 samples/s over 2 ranks" in progress
        torch = "GPU memory (torch): allocated 3.0 GiB · reserved 5.0 GiB · peak 5.0 GiB · summed over 2 GPUs"
        assert torch in progress
        table = app.screen.query_one("#runs-table", RunsTable)
        assert table.get_cell(run_dir.name, "progress").plain == "10/20 (50%) · 2 ranks"
        host = socket.gethostname()
        assert rows(app) == [
            ["0", "running", host, "cuda:0", str(WORKERS[0]), "4/10 (40%)", "2.50 samples/s", ""],
            ["1", "running", host, "cuda:1", str(WORKERS[1]), "6/10 (60%)", "2.50 samples/s", ""],
        ]

        rank_event(run_dir, 1, "rank_failed", message="CUDA out of memory. Tried to allocate 2.0 GiB")
        await wait_for(pilot, lambda: rows(app)[1][1] == "failed")
        assert rows(app)[1][7] == "CUDA out of memory. Tried to allocate 2.0 GiB"
        # rank 1's memory is given back: the torch figures are rank 0's, and NVML's no longer match them
        await wait_for(pilot, lambda: "reserved 2.0 GiB · peak 2.0 GiB\n" in widget_text(app, "#detail-progress"))
        assert "outside torch's" not in widget_text(app, "#detail-progress")

        await pilot.press("g")  # each worker's GPU process is marked with the run
        processes = app.screen.query_one(ProcessList)
        await wait_for(pilot, lambda: len(processes.processes) == 2)
        for process in processes.processes.values():
            assert process.run_id == run_dir.name
            assert run_label(run_dir.name) in process_text(process) and run_dir.name.endswith(run_label(run_dir.name))


async def test_an_ended_run_says_how_each_rank_ended(runs_root: Path) -> None:
    run_dir = make_run(runs_root, ("started", {"pid": 1, "attempt": 1, "scale": "2 process(es)", "nodes": 1}))
    rank_events(run_dir, "node-a", (0, 3, 10), (1, 2, 10))
    rank_event(run_dir, 1, "rank_failed", message="ValueError: shapes do not match")
    EventWriter(run_dir / "events.jsonl").emit("failed", message="rank 1 on node-a: ValueError: shapes do not match")
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.runs.get(run_dir.name) is not None)
        await pilot.pause()
        dashboard = app.screen.query_one("#dashboard-runs", RunsTable)
        assert dashboard.get_cell(run_dir.name, "progress").plain == "5/20 (25%) · 2 ranks"
        await pilot.press("r")
        await wait_for(pilot, lambda: app.current_mode == "runs")
        await pilot.pause()
        # torchrun stopped rank 0 after rank 1 failed: it never said how it ended
        assert [row[:3] for row in rows(app)] == [["0", "stopped", "node-a"], ["1", "failed", "node-a"]]
        assert rows(app)[1][7] == "ValueError: shapes do not match"
        assert "torch): allocated 3.0 GiB" in widget_text(app, "#detail-progress")  # the last figures of both
        await pilot.press("a")  # the kind screen's run pane
        await pilot.pause()
        assert "over 2 ranks" in widget_text(app, "#run-progress")


async def test_the_ranks_fit_the_runs_screen_at_80x24(runs_root: Path) -> None:
    plain = make_run(runs_root, ("started", {"pid": 1, "attempt": 1}), ("finished", {"summary": {}}))
    ranked = make_run(runs_root, ("started", {"pid": 1, "attempt": 1}))
    rank_events(ranked, "node-a", (0, 10, 10), (1, 10, 10))
    rank_event(ranked, 0, "rank_finished")
    rank_event(ranked, 1, "rank_finished")
    EventWriter(ranked / "events.jsonl").emit("finished", summary={})
    app = make_app(screen="runs")
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: len(app.runs.runs) == 2)
        await pilot.pause()
        screen = app.screen
        ranks = screen.query_one("#detail-ranks", RankTable)
        assert screen.table.selected_id == ranked.name and ranks.display
        footer = screen.query_one("AppFooter").region.y
        assert ranks.region.height == 3 and ranks.region.bottom < footer  # the header and both ranks, on screen
        assert screen.query_one("#detail-log").region.y < footer  # the log's tail gives way first (l shows it all)
        assert screen.query_one("#runs-table").region.height >= 8
        await pilot.press("down")  # a run of one process: no rank table, the detail as before
        await pilot.pause()
        assert screen.table.selected_id == plain.name and not ranks.display
