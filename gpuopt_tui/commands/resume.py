"""`gpuopt-tui resume ID`: continue a cancelled, failed or crashed run from its finished shards."""

from __future__ import annotations

import argparse

from gpuopt_tui.commands.follow import console, follow
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.lifecycle import find_run, resume_run

NAME = "resume"
HELP = "resume a cancelled, failed or crashed run (finished shards are not recomputed)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_id", metavar="ID", help="run id or a unique prefix of it")
    parser.add_argument("--detach", action="store_true", help="restart it and return at once")


def run(args: argparse.Namespace) -> int:
    run_dir = find_run(args.run_id)
    events = RunDir(run_dir).events
    before = events.stat().st_size if events.exists() else 0  # the earlier attempts' events were shown then
    pid = resume_run(run_dir)
    console.print(f"resumed {run_dir.name} (pid {pid})")
    if args.detach:
        return 0
    return follow(run_dir, cancel_on_interrupt=True, since=before)
