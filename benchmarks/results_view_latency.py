"""How long a finished run's results take to open from the Runs screen (Enter on its row), per kind.

The app is driven headless with Textual's Pilot at 120x40 on a copy of the frozen runs of the tests
(tests/fixtures/browse_runs: one attribution, TracIn, ablation and plan run). In one process, each run is opened
`--rounds` times, each time in a fresh app (the first opening of a kind in the process imports its view's
modules: a first visit; later ones are later visits). Two times per opening, from posting Enter:
- shown: until the results screen is the app's screen (after a `pilot.pause()`, which lets the pending layout and
  repaint happen);
- drawn: until, after that, the thread workers the screen started have finished and their messages are handled.

    python benchmarks/results_view_latency.py --out benchmarks/results/results_view_latency_cpu.md
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuopt_tui.app import make_app
from gpuopt_tui.ui.screens.results import ResultsScreen
from gpuopt_tui.ui.widgets.runs_table import RunsTable

FROZEN = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "browse_runs"


async def open_once(run_id: str, runs: int) -> tuple[float, float]:
    """(shown, drawn) milliseconds of opening `run_id` from the Runs screen of a fresh app."""
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        while len(app.runs.runs) < runs:
            await pilot.pause()
        await pilot.pause()
        table = app.screen.query_one("#runs-table", RunsTable)
        table.select(run_id)
        table.focus()
        start = time.perf_counter()
        await pilot.press("enter")
        while not isinstance(app.screen, ResultsScreen):
            await pilot.pause()
        await pilot.pause()
        shown = time.perf_counter() - start
        await app.workers.wait_for_complete()
        await pilot.pause()
        drawn = time.perf_counter() - start
    return shown * 1000, drawn * 1000


def p95(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.95 * len(values)) - 1)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp())
    shutil.copytree(FROZEN, home / "runs", ignore=shutil.ignore_patterns("README.md"))
    os.environ["GPUOPT_TUI_HOME"], os.environ["GPUOPT_TUI_RUNS_DIR"] = str(home), str(home / "runs")
    run_ids = sorted(d.name for d in (home / "runs").iterdir() if d.is_dir())
    load = os.getloadavg()
    lines = [
        "| kind | first shown ms | first drawn ms | later shown median / p95 ms | later drawn median / p95 ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for run_id in run_ids:
        times = [asyncio.run(open_once(run_id, len(run_ids))) for _ in range(args.rounds)]
        shown, drawn = ([t[i] for t in times[1:]] for i in (0, 1))
        lines.append(
            f"| {run_id.split('-')[2]} | {times[0][0]:.0f} | {times[0][1]:.0f} | "
            f"{statistics.median(shown):.0f} / {p95(shown):.0f} | {statistics.median(drawn):.0f} / {p95(drawn):.0f} |"
        )
        print(lines[-1], flush=True)
    text = "\n".join(
        [
            "# Opening a run's results from the Runs screen",
            "",
            f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; {platform.machine()}, {os.cpu_count()} "
            f"logical CPUs; Python {platform.python_version()}. Load average (1/5/15 min) at start "
            f"{'/'.join(f'{v:.2f}' for v in load)}.",
            f"Command: `python {shlex.join(sys.argv)}`. Definitions: the docstring of "
            "benchmarks/results_view_latency.py. Headless Pilot, 120x40; later visits: "
            f"{args.rounds - 1} per kind.",
            "",
            *lines,
        ]
    )
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
