"""`gpuopt-tui cancel ID`: stop a run cleanly (its finished shards are kept for resume)."""

from __future__ import annotations

import argparse

from gpuopt_tui.commands.follow import console
from gpuopt_tui.core.events import TERMINAL_TYPES
from gpuopt_tui.core.runs import cancel_run, find_run, wait_for

NAME = "cancel"
HELP = "cancel a running run (SIGTERM to its process group; partial results are flushed)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_id", metavar="ID", help="run id or a unique prefix of it")
    parser.add_argument("--force", action="store_true", help="kill at once (SIGKILL) instead of asking")
    parser.add_argument("--wait", type=float, default=60.0, metavar="S", help="seconds to wait for it to stop")


def run(args: argparse.Namespace) -> int:
    run_dir = find_run(args.run_id)
    cancel_run(run_dir, force=args.force)
    info = wait_for(run_dir, TERMINAL_TYPES | {"crashed"}, args.wait)
    if info.status in ("running", "starting"):
        console.print(f"{info.id} is still stopping; use --force to kill it")
        return 1
    console.print(f"{info.id}: {info.status}. Resume with: gpuopt-tui resume {info.id}")
    return 0
