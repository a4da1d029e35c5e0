"""`gpuopt-tui show ID`: everything about one run: status, error, log tail, results."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from gpuopt_tui.core.format import human_time, safe_text
from gpuopt_tui.core.runs.events import read_events
from gpuopt_tui.core.runs.files import log_tail, result_files
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.lifecycle import find_run
from gpuopt_tui.core.runs.startup import startup_headline, startup_lines, startup_stages
from gpuopt_tui.core.runs.status import RunInfo, RunWatcher, stage_text

NAME = "show"
HELP = "show one run: status, message, progress, the tail of its log and its result files"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_id", metavar="ID", help="run id or a unique prefix of it")
    parser.add_argument("--lines", type=int, default=20, help="log lines to show")


def run(args: argparse.Namespace) -> int:
    run_dir = find_run(args.run_id)
    info = RunWatcher(run_dir.parent).info(run_dir)
    out = Console(highlight=False)
    out.print(f"[bold]{info.id}[/]  {escape(info.kind)}  '{escape(info.name)}'  status: [bold]{info.status}[/]")
    out.print(f"  created {human_time(info.created)}   attempt {info.attempt}   pid {info.pid or '-'}")
    out.print(f"  directory {info.dir}", markup=False)
    if info.message:
        out.print(f"  message: {info.message}", markup=False)
    if info.progress:
        progress = info.progress
        if "total" in progress:
            count = f"{progress.get('done')}/{progress.get('total')} {progress.get('unit', '')}".rstrip()
            out.print(f"  progress: {count}", markup=False)
        if stage := stage_text(progress):
            out.print(f"  stage: {stage}", markup=False)
    _print_ranks(out, info)
    _print_startup(out, run_dir)
    if info.corrupt_lines:
        out.print(f"  [yellow]{info.corrupt_lines} unreadable line(s) in {RunDir.EVENTS} were skipped[/]")
    results = result_files(run_dir)
    if results:
        out.print("  results:")
        for p in results:
            out.print(f"    {safe_text(p)}", markup=False)
    tail = log_tail(run_dir, args.lines)
    if tail:
        out.print(f"  last {len(tail)} lines of {RunDir.LOG}:")
        for line in tail:
            out.print(f"    {line}", markup=False)
    return 0


def _print_startup(out: Console, run_dir: Path) -> None:
    """Where the seconds went from the launch to the first computed batch, stage by stage (core/runs/startup.py)."""
    events, _ = read_events(RunDir(run_dir).events, skim=True)  # skimming keeps every event but old progress
    stages = startup_stages(events)
    if stages:
        out.print(f"  start-up: {startup_headline(stages)}", markup=False)
        for line in startup_lines(stages):
            out.print(f"    {line}", markup=False)


def _print_ranks(out: Console, info: RunInfo) -> None:
    """One line per rank of a run over several processes: its state, where it runs, its own progress."""
    if not info.rank_progress:
        return
    workers = {w.rank: w for w in info.workers}
    out.print(f"  ranks ({len(info.rank_progress)}):")
    for rank, progress in info.rank_progress.items():
        worker = workers.get(rank)
        where = f"{worker.host} {worker.device} pid {worker.pid}" if worker else "not started"
        done = f"{progress['done']}/{progress.get('total')} {progress.get('unit', '')}" if "done" in progress else "-"
        message = f"  {progress['message']}" if progress["message"] else ""
        out.print(f"    {rank}: {progress['state']:<9}  {where}  {done}{message}", markup=False)
