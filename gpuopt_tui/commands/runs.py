"""`gpuopt-tui runs`: list runs with their status and progress."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpuopt_tui.core.format import human_duration, human_time
from gpuopt_tui.core.runs.lifecycle import unreadable_runs_dir
from gpuopt_tui.core.runs.status import RunWatcher, stage_text

NAME = "runs"
HELP = "list runs (running, finished, failed, cancelled, crashed, damaged)"
STATUS_STYLE = {
    "running": "cyan",
    "starting": "cyan",
    "finished": "green",
    "failed": "red",
    "crashed": "red",
    "damaged": "red",
    "cancelled": "yellow",
    "missing": "red",
}
COLUMNS = ("id", "kind", "name", "status", "progress", "eta", "created", "message")
# the id spells the kind and the creation time: where the table is too wide these go first, so that the rest
# need not be cut
REDUNDANT = ("created", "kind")


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number of runs, 0 for all; got {text!r}")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object per run, for scripts")
    parser.add_argument("--limit", type=_limit, default=50, help="show at most this many, newest first (0: all)")


def run(args: argparse.Namespace) -> int:
    watcher = RunWatcher()
    try:
        infos = watcher.refresh()
    except OSError as e:
        raise unreadable_runs_dir(watcher.root, e) from None
    shown = infos[: args.limit] if args.limit else infos
    if args.json:
        for i in shown:
            record = {
                "id": i.id,
                "kind": i.kind,
                "name": i.name,
                "status": i.status,
                "pid": i.pid,
                "created": i.created,
                "done": i.progress.get("done"),
                "total": i.progress.get("total"),
                "stage": i.progress.get("stage"),
                "message": i.message,
                "dir": str(i.dir),
            }
            print(json.dumps(record))
        return 0
    if not infos:
        Console().print(f"no runs yet in {watcher.root}. Start one with: gpuopt-tui run demo-attribution", markup=False)
        return 0
    rows = []
    for i in shown:
        frac = i.fraction
        prog = f"{i.progress.get('done')}/{i.progress.get('total')} ({frac:.0%})" if frac is not None else ""
        if i.active and "total" not in i.progress:  # a stage without a count: what the run is doing
            prog = stage_text(i.progress)
        eta = human_duration(i.progress.get("eta")) if i.active and i.progress.get("eta") else ""
        style = STATUS_STYLE.get(i.status, "")
        status = Text(i.status, style=style)
        rows.append((i.id, i.kind, i.name, status, prog, eta, human_time(i.created), i.message[:80]))
    console = Console()
    console.print(_table(rows, console.width))
    if len(shown) < len(infos):
        console.print(f"{len(infos) - len(shown)} older run(s) not shown (--limit 0 shows all)")
    console.print(f"runs directory: {watcher.root}", markup=False, highlight=False, soft_wrap=True)
    return 0


def _table(rows: list[tuple], width: int) -> Table:
    """Ids, names and statuses are never cut or wrapped (an id is what other commands take); columns empty in
    every row are left out; the message wraps, and the others are cut with an ellipsis only when nothing else
    is left to give way."""
    kept = [c for c, name in enumerate(COLUMNS) if name in ("id", "name") or any(str(r[c]) for r in rows)]

    def natural(c: int) -> int:
        if COLUMNS[c] == "message":
            return len("message")
        return max(len(COLUMNS[c]), *(len(str(row[c])) for row in rows))

    for name in REDUNDANT:
        if sum(natural(c) for c in kept) + 2 * (len(kept) - 1) <= width:
            break
        kept.remove(COLUMNS.index(name))
    table = Table(box=None, header_style="bold", pad_edge=False)
    for c in kept:
        name = COLUMNS[c]
        if name in ("id", "name", "status"):
            table.add_column(name, no_wrap=True, min_width=natural(c))
        elif name == "message":
            table.add_column(name, overflow="fold", min_width=len(name), ratio=1)
        else:
            table.add_column(name, no_wrap=True, overflow="ellipsis")
    for row in rows:
        table.add_row(*(Text(str(row[c])) if isinstance(row[c], str) else row[c] for c in kept))  # never markup
    return table
