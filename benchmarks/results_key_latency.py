"""How long the keys of a causal LM run's results take to answer, on a run of the size of issue 34's 1B-model run.

The run (benchmarks/lm_results_run.py) is opened from the Runs screen with enter once the app's warm-up is done, as
results_view_latency.py opens it; then each key of KEYS is sent at once, in turn, --rounds times, from the focus
the screen opens with (its tab bar). A key's time runs from posting it to the app until nothing is queued in the
app or under its screen, the repaint is done and no worker under the screen is running (results_view_latency.py's
definitions). Goal: every key <= 100 ms.

    python benchmarks/results_key_latency.py --out benchmarks/results/results_key_latency_lm_cpu.md
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results_view_latency import _lm_run, _screen_workers_done, _settled, _uptime, _versions

# (key, character, what it does on the Samples tab)
KEYS: tuple[tuple[str, str, str], ...] = (
    ("full_stop", ".", "next completion token"),
    ("comma", ",", "previous completion token"),
    ("s", "s", "next sort order (2048 samples)"),
    ("right_square_bracket", "]", "next page"),
    ("left_square_bracket", "[", "previous page"),
)


async def _drive(run_dir: Path, rounds: int) -> dict[str, list[float]]:
    from textual import events

    from gpuopt_tui.app import make_app
    from gpuopt_tui.ui.screens.results import ResultsScreen
    from gpuopt_tui.ui.widgets.runs_table import RunsTable

    app = make_app(screen="runs")
    times: dict[str, list[float]] = {key: [] for key, _, _ in KEYS}
    async with app.run_test(size=(120, 40)) as pilot:
        while app.startup_seconds is None or app.runs.get(run_dir.name) is None or not app.warmup.done:
            await asyncio.sleep(0.05)
        table = app.screen.query_one(RunsTable)
        table.select(run_dir.name)
        table.focus()
        await _settled(pilot, app, lambda: True)
        app._driver.send_message(events.Key("enter", "\r"))  # type: ignore[union-attr]
        await _settled(pilot, app, lambda: isinstance(app.screen, ResultsScreen) and _screen_workers_done(app))
        for _ in range(rounds):
            for key, character, _ in KEYS:
                start = time.perf_counter()
                app._driver.send_message(events.Key(key, character))  # type: ignore[union-attr]
                await _settled(pilot, app, lambda: _screen_workers_done(app))
                times[key].append((time.perf_counter() - start) * 1000)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = _lm_run(Path(tmp))
        os.environ["GPUOPT_TUI_RUNS_DIR"] = str(run_dir.parent)
        os.environ["GPUOPT_TUI_HOME"] = str(Path(tmp) / "home")
        start_uptime = _uptime()
        gc.disable()  # as `gpuopt-tui` starts the app; it turns the collector on after its first frame
        times = asyncio.run(_drive(run_dir, args.rounds))
    rows = [
        f"| `{character}` | {what} | {statistics.median(times[key]):.0f} | {max(times[key]):.0f} |"
        for key, character, what in KEYS
    ]
    text = "\n".join([
        "# Keys of a causal LM run's results (2048 prompts, 16-token completions, per completion token)",
        "",
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; machine: {platform.machine()}, {os.cpu_count()} logical "
        f"CPUs; {_versions()}.",
        f"`uptime` at start: `{start_uptime}`; at end: `{_uptime()}`.",
        f"Command: `python benchmarks/results_key_latency.py {' '.join(sys.argv[1:])}`",
        "Terminal 120x40 (headless Pilot); the run opened from Runs once the warm-up was done; keys sent at once from "
        f"the focus the screen opens with, {args.rounds} rounds. Goal: every key <= 100 ms.",
        "",
        "| key | does | median ms | max ms |",
        "|---|---|---:|---:|",
        *rows,
        "",
    ])  # fmt: skip
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
