"""`gpuopt-tui attach ID`: follow a run's progress; Ctrl-C detaches and leaves the run going."""

from __future__ import annotations

import argparse

from gpuopt_tui.commands.follow import follow
from gpuopt_tui.core.runs.lifecycle import find_run

NAME = "attach"
HELP = "follow a run's progress (Ctrl-C detaches; the run goes on)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_id", metavar="ID", help="run id or a unique prefix of it")


def run(args: argparse.Namespace) -> int:
    return follow(find_run(args.run_id), cancel_on_interrupt=False)
