"""`gpuopt-tui join RUN`: start this node's workers of a run over several nodes.

The run was started on one node with `nodes > 1` and a `rendezvous` host:port; every other node runs this
(with the run directory on a filesystem all nodes share). It runs the same torchrun command as the first
node, in the foreground, and exits with its code.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
from pathlib import Path

from gpuopt_tui.commands.follow import console
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.io import load_profile
from gpuopt_tui.core.runs.distributed import scale_of, torchrun_command, torchrun_env
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.lifecycle import find_run
from gpuopt_tui.core.runs.processes import NEUTRAL_CWD

NAME = "join"
HELP = "join a run over several nodes from another node (runs its torchrun command here)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="the run's directory, or its id in the runs directory")
    parser.add_argument("--print", action="store_true", help="only print the torchrun command")


def run(args: argparse.Namespace) -> int:
    path = Path(args.run).expanduser()
    run_dir = (path if RunDir(path).meta.is_file() else find_run(args.run)).resolve()
    profile = load_profile(RunDir(run_dir).profile)
    scale = scale_of(profile.run)
    if scale.nodes < 2:
        raise UserError(f"run {run_dir.name} runs on one node (run.nodes = {scale.nodes}); there is nothing to join")
    cmd = torchrun_command(run_dir, scale)
    env = torchrun_env(scale)
    shown = (f"CUDA_VISIBLE_DEVICES={scale.visible} " if scale.visible else "") + shlex.join(cmd)
    if args.print:
        print(shown)
        return 0
    console.print(f"joining run {run_dir.name} ({scale.describe()}): {shown}")
    try:
        return subprocess.call(cmd, env=env, cwd=NEUTRAL_CWD)  # nothing in this directory is imported
    except KeyboardInterrupt:
        return 130
