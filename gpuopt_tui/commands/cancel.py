"""`gpuopt-tui cancel ID`: stop a run cleanly (its finished shards are kept for resume)."""

from __future__ import annotations

import argparse
import math

from gpuopt_tui.commands.follow import console
from gpuopt_tui.core.runs.lifecycle import cancel_run, find_run, still_running, wait_stopped

NAME = "cancel"
HELP = "cancel a running run (SIGTERM to its process group; partial results are flushed)"


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0; got {text!r}")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_id", metavar="ID", help="run id or a unique prefix of it")
    parser.add_argument("--force", action="store_true", help="kill at once (SIGKILL) instead of asking")
    parser.add_argument("--wait", type=_seconds, default=60.0, metavar="S", help="seconds to wait for it to stop")


def run(args: argparse.Namespace) -> int:
    run_dir = find_run(args.run_id)
    cancel_run(run_dir, force=args.force)
    info = wait_stopped(run_dir, args.wait)
    if still_running(info):
        console.print(f"{info.id} is still stopping; use --force to kill it")
        return 1
    console.print(f"{info.id}: {info.status}. Resume with: gpuopt-tui resume {info.id}")
    return 0
