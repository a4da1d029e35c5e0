"""`gpuopt-tui warm`: keep a warm runner for the runs `gpuopt-tui run` starts (core/runs/warm.py); --stop ends it."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console

from gpuopt_tui.commands.follow import console
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.runs.processes import pid_alive
from gpuopt_tui.core.runs.warm import ready_runners, start_warm_runner, stop_warm_runners

NAME = "warm"
HELP = (
    "keep a warm runner (torch, transformers and the engines imported) so that the next `gpuopt-tui run` from this "
    "environment starts computing at once; each run it takes leaves a new one"
)
READY_TIMEOUT_S = 300.0  # imports on a loaded machine take tens of seconds


def _minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 7 * 24 * 60:
        raise argparse.ArgumentTypeError(f"expected minutes above 0 (at most a week); got {text!r}")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--minutes", type=_minutes, default=60.0, metavar="M", help="end after M minutes without a run (default 60)"
    )
    parser.add_argument("--stop", action="store_true", help="end the warm runners that are waiting")
    parser.add_argument("--list", action="store_true", help="list the warm runners that are waiting")
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="DIR",
        help="a local model directory whose weights it reads ahead, for a run on that model (repeatable)",
    )


def run(args: argparse.Namespace) -> int:
    if args.list:
        _list()
    elif args.stop:
        stopped = stop_warm_runners()
        pids = f": {', '.join(map(str, stopped))}" if stopped else ""
        console.print(f"stopped {len(stopped)} warm runner(s){pids}")
    else:
        _start(args.minutes, tuple(args.model))
    return 0


def _list() -> None:
    """On standard output, a line per runner (the start and stop messages go to standard error, as `run`'s do)."""
    out = Console(highlight=False)
    runners = ready_runners()
    for runner in runners:
        ends = f"kept by process {runner.owner}" if runner.owner else f"ends after {runner.minutes:g} min without a run"
        models = f"  models read: {', '.join(runner.models)}" if runner.models else ""
        out.print(f"{runner.pid}  ready  {ends}{models}", markup=False)
    if not runners:
        out.print("no warm runner is waiting (`gpuopt-tui warm` starts one)", markup=False)


def _start(minutes: float, models: tuple[str, ...]) -> None:
    missing = [m for m in models if not (Path(m).expanduser() / "config.json").is_file()]
    if missing:
        raise UserError(f"--model {missing[0]}: not a model directory (no config.json)")
    started = time.monotonic()
    try:
        pid = start_warm_runner(owner=None, minutes=minutes, replace=True, models=models)
    except OSError as e:
        raise UserError(f"cannot start a warm runner ({e.strerror or e})") from None
    reading = f" and reading {len(models)} model(s)" if models else ""
    with console.status(f"warm runner: importing torch, transformers and the engines{reading}..."):
        while not any(r.pid == pid for r in ready_runners()):
            if not pid_alive(pid):
                raise UserError(f"the warm runner (pid {pid}) ended while importing; run `python -m gpuopt_tui.jobs "
                                "--warm --minutes 1` to see why")  # fmt: skip
            if time.monotonic() - started > READY_TIMEOUT_S:
                raise UserError(f"the warm runner (pid {pid}) is still importing after {READY_TIMEOUT_S:.0f} s")
            time.sleep(0.1)
    console.print(
        f"warm runner {pid} ready after {time.monotonic() - started:.1f} s: the next `gpuopt-tui run` with this "
        f"environment takes it and leaves a new one; it ends after {minutes:g} min without a run "
        "(`gpuopt-tui warm --stop` ends it now)"
    )
