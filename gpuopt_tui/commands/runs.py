"""`gpuopt-tui runs`: list runs with their status and progress."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpuopt_tui.core.format import human_duration, human_time
from gpuopt_tui.core.runs import RunWatcher

NAME = "runs"
HELP = "list runs (running, finished, failed, cancelled, crashed)"
STATUS_STYLE = {
    "running": "cyan",
    "starting": "cyan",
    "finished": "green",
    "failed": "red",
    "crashed": "red",
    "cancelled": "yellow",
    "missing": "red",
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object per run, for scripts")
    parser.add_argument("--limit", type=int, default=50, help="show at most this many (newest first)")


def run(args: argparse.Namespace) -> int:
    watcher = RunWatcher()
    infos = watcher.refresh()[: args.limit]
    if args.json:
        for i in infos:
            print(
                json.dumps(
                    {
                        "id": i.id,
                        "kind": i.kind,
                        "name": i.name,
                        "status": i.status,
                        "pid": i.pid,
                        "created": i.created,
                        "done": i.progress.get("done"),
                        "total": i.progress.get("total"),
                        "message": i.message,
                        "dir": str(i.dir),
                    }
                )
            )
        return 0
    if not infos:
        Console().print(f"no runs yet in {watcher.root}. Start one with: gpuopt-tui run demo-attribution")
        return 0
    rows = []
    for i in infos:
        frac = i.fraction
        prog = f"{i.progress.get('done')}/{i.progress.get('total')} ({frac:.0%})" if frac is not None else ""
        eta = human_duration(i.progress.get("eta")) if i.active and i.progress.get("eta") else ""
        style = STATUS_STYLE.get(i.status, "")
        status = Text(i.status, style=style)
        rows.append((i.id, i.kind, i.name, status, prog, eta, human_time(i.created), i.message[:80]))
    # ids and names are never cut or wrapped (an id is what other commands take); columns empty in every row are
    # left out, and the rest give way: the message wraps, short fields are cut with an ellipsis
    columns = ("id", "kind", "name", "status", "progress", "eta", "created", "message")
    shown = [c for c, name in enumerate(columns) if name in ("id", "kind", "name") or any(str(r[c]) for r in rows)]
    table = Table(box=None, header_style="bold")
    for c in shown:
        name = columns[c]
        if name in ("id", "name"):
            table.add_column(name, no_wrap=True, min_width=max(len(str(row[c])) for row in rows))
        elif name == "message":
            table.add_column(name, overflow="fold", min_width=len(name), ratio=1)
        else:
            table.add_column(name, no_wrap=True, overflow="ellipsis")
    for row in rows:
        table.add_row(*(Text(str(row[c])) if isinstance(row[c], str) else row[c] for c in shown))  # never markup
    Console().print(table)
    return 0
