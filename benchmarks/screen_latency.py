"""How fast the app answers: time to the first frame, and per-screen switch latency, first and later visits.

The app is driven headless with Textual's Pilot at a fixed size (120x40 by default), with an empty data
directory (its own GPUOPT_TUI_HOME and runs directory, so the shipped demo profiles are the ones opened) and the
GPU source the CLI would use (live NVML, or `--replay TRACE`). Each of `--processes` fresh Python processes:

- first frame: seconds from the process's start (/proc, imports included) until the app's `on_ready`, i.e. the
  first screen was composed and painted: what `GpuOptApp.startup_seconds` records;
- then `--rounds` rounds of pressing each screen's key in turn (a, t, b, p, r, g, then d for the dashboard), each
  press `--think` seconds after the previous switch was done (0, the default: at once, faster than any user, so
  the screens' first visits come before the app's warm-up of them after its first frame, see gpuopt_tui/ui/warmup.py;
  about a second: a user who reads each screen).
  One switch's latency is measured from posting the key event to the app until all of these hold:
  `app.screen` is the target screen; the message queues of the app, that screen and every widget under it are
  empty (Pilot's `_wait_for_screen`, repeated until a pass finds nothing queued); the screen's pending layout
  and repaint were done (its update timer's handler, called at once as `pilot.pause()` does, so the up to
  16 ms until that timer fires is not counted). Work handed to thread workers is not waited for. Between two
  switches the app is left idle (`pilot.pause()`, not timed). Beside this wall-clock latency, the process's CPU
  time over the same interval (`time.process_time()`, all its threads): on a shared machine it moves much less
  with other processes' load than the wall-clock figure.
  The first press of a key in a process is a first visit (the screen is built: its module imported, composed,
  mounted, styled); later presses are later visits. The dashboard is built at start-up: all its visits are later
  visits.
- widgets per screen: `len(list(screen.walk_children()))` once it is shown (in the last round).

The processes import gpuopt_tui from compiled bytecode, as an installed copy (or a checkout run once before) does:
they run a copy of the package compiled beforehand, also where PYTHONDONTWRITEBYTECODE is set (compiling its
sources again in each process adds 40-50 ms to the first frame and to each screen's first visit).

Reported: first frame and first visits over processes, later visits pooled over processes x (rounds - 1):
median and p95 (nearest rank). The machine's load average is written with the results: on a shared machine
other processes' work inflates every figure.

    python benchmarks/screen_latency.py --out benchmarks/results/screen_latency_cpu.md
    python benchmarks/screen_latency.py --quick   # 2 processes x 2 rounds, printed only

The processes import gpuopt_tui from a copy of this script's checkout, made when the measurement starts.
"""

from __future__ import annotations

import argparse
import asyncio
import compileall
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEYS = ("a", "t", "b", "p", "r", "g", "d")
GOALS = "switch p95 <= 250 ms for every screen, later visits <= 100 ms, first frame <= 0.5 s"


async def _settled(pilot: object, app: object, target: str) -> None:
    """Return once `target` is the shown screen with nothing queued anywhere under it, and it is painted."""
    while True:
        await pilot._wait_for_screen()  # type: ignore[attr-defined]
        screen = app.screen  # type: ignore[attr-defined]
        pumps = [app, *screen.walk_children(with_self=True)]
        if app.current_mode == target and all(p._message_queue.empty() for p in pumps):  # type: ignore[attr-defined]
            screen._on_timer_update()
            return


async def _drive(size: tuple[int, int], rounds: int, think: float, replay: Path | None) -> dict[str, object]:
    from textual import events

    from gpuopt_tui.app import make_app
    from gpuopt_tui.ui.screens.registry import SCREENS

    names = {s.key: s.name for s in SCREENS}
    app = make_app(replay=replay)
    visits: dict[str, list[float]] = {names[k]: [] for k in KEYS}
    cpu: dict[str, list[float]] = {names[k]: [] for k in KEYS}
    widgets: dict[str, int] = {}
    async with app.run_test(size=size) as pilot:
        while app.startup_seconds is None:
            await asyncio.sleep(0.01)
        await pilot.pause()
        for _ in range(rounds):
            for key in KEYS:
                name = names[key]
                await asyncio.sleep(think)
                start, start_cpu = time.perf_counter(), time.process_time()
                app._driver.send_message(events.Key(key, key))  # type: ignore[union-attr]
                await _settled(pilot, app, name)
                visits[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
                widgets[name] = len(list(app.screen.walk_children()))
                await pilot.pause()
    return {"first_frame": app.startup_seconds, "visits": visits, "cpu": cpu, "widgets": widgets}


def _child(args: argparse.Namespace) -> None:
    import gc

    gc.disable()  # as `gpuopt-tui` starts the app (cli.run_tui): the app turns the collector on after its first frame
    result = asyncio.run(_drive((args.width, args.height), args.rounds, args.think, args.replay))
    print(json.dumps(result))


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def ms(values: list[float]) -> str:
    if not values:
        return "n/a | n/a"
    return f"{statistics.median(values) * 1000:.0f} | {p95(values) * 1000:.0f}"


def median_ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.0f}" if values else "n/a"


def visits(results: list[dict[str, object]], field: str, screen: str) -> tuple[list[float], list[float]]:
    """First visits (one a process; none for the dashboard, built at start) and later visits, pooled."""
    runs = [r[field][screen] for r in results]  # type: ignore[index]
    if screen == "dashboard":
        return [], [x for v in runs for x in v]
    return [v[0] for v in runs], [x for v in runs for x in v[1:]]


def _run_processes(args: argparse.Namespace) -> list[dict[str, object]]:
    results = []
    with tempfile.TemporaryDirectory(prefix="screen-latency-") as tmp:
        package = Path(tmp) / "src" / "gpuopt_tui"
        shutil.copytree(REPO / "gpuopt_tui", package, ignore=shutil.ignore_patterns("__pycache__"))
        if not compileall.compile_dir(package, quiet=1):
            raise SystemExit(f"{package} did not compile")
        env = {
            **os.environ,
            "PYTHONPATH": str(package.parent),
            "GPUOPT_TUI_HOME": str(Path(tmp) / "home"),
            "GPUOPT_TUI_RUNS_DIR": str(Path(tmp) / "home" / "runs"),
            "OMP_NUM_THREADS": "1",
        }
        env.pop("TEXTUAL_ANIMATIONS", None)
        command = [sys.executable, __file__, "--child", "--rounds", str(args.rounds), "--think", str(args.think)]
        command += ["--width", str(args.width), "--height", str(args.height)]
        if args.replay:
            command += ["--replay", str(args.replay)]
        for index in range(args.processes):
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout, check=False)
            if done.returncode != 0:
                raise SystemExit(f"process {index + 1} failed:\n{done.stderr[-3000:]}")
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"process {index + 1}/{args.processes} done", file=sys.stderr)
    return results


def _versions() -> str:
    from importlib.metadata import version

    return f"Python {platform.python_version()}, textual {version('textual')}, rich {version('rich')}"


def report(args: argparse.Namespace, results: list[dict[str, object]], load: tuple[list[float], list[float]]) -> str:
    firsts = [float(r["first_frame"]) for r in results]  # type: ignore[arg-type]
    lines = [
        f"# Screen switch latency ({args.label})",
        "",
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; machine: {args.machine}, {os.cpu_count()} logical CPUs, "
        f"{platform.processor() or platform.machine()}; {_versions()}.",
        f"Load average (1/5/15 min) at start {'/'.join(f'{v:.2f}' for v in load[0])}, "
        f"at end {'/'.join(f'{v:.2f}' for v in load[1])}." + (f" {args.note}" if args.note else ""),
        f"Terminal {args.width}x{args.height} (headless Pilot), {args.processes} fresh processes x {args.rounds} "
        f"rounds of keys {' '.join(KEYS)}, each {args.think:g} s after the previous switch was done; "
        f"GPU source: {args.replay or 'live NVML (none on this machine)'}.",
        f"Command: `{shlex.join(['python', 'benchmarks/screen_latency.py', *args.argv])}`",
        f"Goal: {GOALS}. Definitions: the docstring of benchmarks/screen_latency.py.",
        "",
        f"First frame (process start to the first painted screen): median {statistics.median(firsts):.2f} s, "
        f"p95 {p95(firsts):.2f} s (n = {len(firsts)}).",
        "",
        "| screen | key | widgets | first visit median ms | first visit p95 ms | first visit CPU median ms "
        "| later visits median ms | later visits p95 ms | later visits CPU median ms | later n |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    from gpuopt_tui.ui.screens.registry import SCREENS

    for spec in (s for key in KEYS for s in SCREENS if s.key == key):
        first, later = visits(results, "visits", spec.name)
        first_cpu, later_cpu = visits(results, "cpu", spec.name)
        widgets = results[-1]["widgets"][spec.name]  # type: ignore[index]
        lines.append(
            f"| {spec.label} | {spec.key} | {widgets} | {ms(first)} | {median_ms(first_cpu)} | {ms(later)} "
            f"| {median_ms(later_cpu)} | {len(later)} |"
        )
    lines += ["", "The dashboard is the first screen: its first visit is the first frame above."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=5, help="fresh processes (first visits: one each)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of every key per process")
    parser.add_argument("--width", type=int, default=120)
    parser.add_argument("--height", type=int, default=40)
    parser.add_argument("--think", type=float, default=0.0, help="seconds idle before each key press (default 0)")
    parser.add_argument("--replay", type=Path, help="a GPU trace to replay instead of live NVML")
    parser.add_argument("--quick", action="store_true", help="2 processes x 2 rounds, a check that it works")
    parser.add_argument("--out", type=Path, help="write the markdown results here")
    parser.add_argument("--label", default="CPU", help="the results' title, e.g. before / after a change")
    parser.add_argument("--machine", default="2-core CPU dev machine", help="how the results name the machine")
    parser.add_argument("--note", default="", help="a sentence added after the load average")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per process")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    if args.child:
        _child(args)
        return 0
    if args.quick:
        args.processes, args.rounds = 2, 2
    load_start = list(os.getloadavg())
    results = _run_processes(args)
    text = report(args, results, (load_start, list(os.getloadavg())))
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
