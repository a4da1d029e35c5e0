"""`torchrun ... -m gpuopt_tui.jobs.worker RUN_DIR`: one rank of a run over several processes.

Each rank runs the kind's engine with a JobContext that knows its rank (the engines shard their work by
it and rank 0 merges) and appends its events, stamped with its rank, to the run's events.jsonl. The run's
own process (jobs/runner.py) turns the ranks' `rank_finished` / `rank_failed` / `rank_cancelled` into the
run's outcome.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch

from gpuopt_tui.core.atomic import write_json
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.paths import cache_dir
from gpuopt_tui.core.profiles.io import load_profile
from gpuopt_tui.core.runs.events import EventWriter
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.processes import proc_start_time
from gpuopt_tui.jobs.collective import init_from_torchrun, shutdown
from gpuopt_tui.jobs.context import JobContext
from gpuopt_tui.jobs.runner import EXIT_CODES, execute, on_stop_signals

SHARED_FS = "a run over several nodes needs its run directory on a filesystem every node shares"


def run(run_dir: Path) -> int:
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    host = socket.gethostname()
    files = RunDir(run_dir)
    if not files.profile.is_file():
        print(f"[error] rank {rank} on {host}: {run_dir} has no {RunDir.PROFILE} ({SHARED_FS})", flush=True)
        return 1
    events = EventWriter(files.events, rank=rank)
    try:
        profile = load_profile(files.profile)
        use_cuda = profile.run.device != "cpu" and torch.cuda.is_available()
        profile.run.device = f"cuda:{local_rank}" if use_cuda else "cpu"
        dist = init_from_torchrun(use_cuda)
    except UserError as e:
        report(run_dir, events.emit("rank_failed", host=host, message=str(e)))
        return 1
    ctx = JobContext(run_dir, events, cache_dir(), dist=dist)
    on_stop_signals(ctx.request_cancel)
    pid = os.getpid()
    events.emit("rank_started", host=host, pid=pid, start_time=proc_start_time(pid), device=profile.run.device)
    print(f"[info] rank {rank}/{dist.world_size} on {host}, {profile.run.device}", flush=True)
    try:
        kind, fields = execute(profile, ctx)
        if kind == "finished" and rank != 0:
            fields = {}  # rank 0 holds the merged results' summary
        report(run_dir, events.emit(f"rank_{kind}", host=host, **fields))
        if kind == "finished":
            shutdown(dist)  # a clean exit; after a failure torchrun stops the others instead
        return EXIT_CODES[kind]
    finally:
        events.sync()
        events.close()


def report(run_dir: Path, event: dict[str, Any]) -> None:
    """Also keep how this rank ended as a file of its own (replaced whole): lines appended to one file from
    several hosts of a network filesystem may be lost, and the run's outcome must not be."""
    files = RunDir(run_dir)
    files.ranks.mkdir(exist_ok=True)
    write_json(files.rank_report(event["rank"]), event)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: torchrun ... -m gpuopt_tui.jobs.worker RUN_DIR", file=sys.stderr)
        return 2
    return run(Path(argv[0]))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
