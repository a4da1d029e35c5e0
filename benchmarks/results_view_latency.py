"""How long a finished run's results take to open from the Runs screen (enter on its row), per kind.

The app is driven headless with Textual's Pilot at 120x40 on a copy of the frozen runs of the tests
(tests/fixtures/browse_runs: one attribution, TracIn, ablation (probing) and plan run) and, for the kind
"attribution-lm", those and a causal LM run of the size of issue 34's 1B-model run (2048 prompts of 64-512 tokens,
16-token completions, per completion token: benchmarks/lm_results_run.py), written once per invocation into its
temporary folder (seeded: the same files every time) and hard-linked into each process's runs folder. Each of `--processes`
fresh Python processes per kind starts the app on the Runs screen as `gpuopt-tui` does (garbage collector off
until the first frame), waits until the runs are listed (with `--warmed`, until the app's warm-up is done, too)
and `--think` seconds more, then opens that kind's run `--rounds` times, going back to the Runs screen with
escape in between, as a user does. The first opening in a process is a first opening (the view's modules may
still be imported, and the app's warm-up, see gpuopt_tui/ui/warmup.py, may be going on or may have made the
kind's results screen ahead); later ones are later openings.

Two times per opening, from posting the enter key event to the app:
- shown: until the results screen is the app's screen, the message queues of the app, that screen and every widget
  under it are empty, and the screen's pending layout and repaint were done (as benchmarks/screen_latency.py
  defines a switch's latency: nothing is slept, so the figure has no 20 ms polling steps in it);
- drawn: until, after that, the thread workers started under the results screen (reading the run's files) have
  finished and the same holds again: the run's results are on screen (for attribution, its sample list and the
  heatmap of its first sample).
Beside the wall-clock figures, the CPU time of the process over the opening (all its threads). Looking again at
once keeps the UI thread busy while the run's files are read in threads, so that they get the GIL about half the
time; with `--poll-ms`, each look sleeps first, as an idle app's UI thread leaves the GIL to them (the figures then
have steps of that size in them).

With `--baseline REF`, the package as committed at REF is measured in the same run, its processes alternating with
those of this checkout's package, so that both see the same load. Both are copies compiled beforehand (as an
installed package is). The load average (`os.getloadavg`, what `uptime` prints) is recorded before each process.

    python benchmarks/results_view_latency.py --baseline main --out benchmarks/results/results_view_latency_cpu.md
"""

from __future__ import annotations

import argparse
import asyncio
import compileall
import io
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FROZEN = REPO / "tests" / "fixtures" / "browse_runs"
KINDS = ("attribution", "tracin", "ablation", "plan", "attribution-lm")
LM_KIND = "attribution-lm"
GOALS = "every kind: opening p95 <= 250 ms (first openings included); first samples drawn <= 400 ms"


POLL_S = 0.0  # --poll-ms: how long each look at the app sleeps (0: it looks again at once)


async def _settled(pilot: object, app: object, done: object) -> None:
    """Return once `done()` holds with nothing queued in the app or anywhere under its screen, and it is painted."""
    while True:
        if POLL_S:
            await asyncio.sleep(POLL_S)
        await pilot._wait_for_screen()  # type: ignore[attr-defined]
        screen = app.screen  # type: ignore[attr-defined]
        pumps = [app, *screen.walk_children(with_self=True)]
        if done() and all(p._message_queue.empty() for p in pumps):  # type: ignore[attr-defined, operator]
            screen._on_timer_update()
            return


def _screen_workers_done(app: object) -> bool:
    screen = app.screen  # type: ignore[attr-defined]
    return not any(
        not w.is_finished and (w.node is screen or screen in w.node.ancestors)  # type: ignore[attr-defined]
        for w in app.workers  # type: ignore[attr-defined]
    )


def _run_name(kind: str) -> str:
    """The name of the run directory that `kind`'s processes open."""
    if kind == LM_KIND:
        from benchmarks.lm_results_run import RUN_NAME

        return RUN_NAME
    return next(d.name for d in FROZEN.iterdir() if d.is_dir() and d.name.split("-")[2] == kind)


async def _drive(run_name: str, rounds: int, think: float, warmed: bool) -> dict[str, object]:
    from textual import events

    from gpuopt_tui.app import make_app
    from gpuopt_tui.ui.screens.results import ResultsScreen
    from gpuopt_tui.ui.widgets.runs_table import RunsTable

    run_dir = Path(os.environ["GPUOPT_TUI_RUNS_DIR"]) / run_name
    app = make_app(screen="runs")
    times: dict[str, list[float]] = {"shown": [], "drawn": [], "cpu": []}
    widgets = 0
    async with app.run_test(size=(120, 40)) as pilot:
        while app.startup_seconds is None or app.runs.get(run_dir.name) is None:
            await asyncio.sleep(0.01)
        await pilot.pause()
        while warmed and not app.warmup.done:
            await asyncio.sleep(0.05)
        await asyncio.sleep(think)
        for _ in range(rounds):
            table = app.screen.query_one(RunsTable)
            table.select(run_dir.name)
            table.focus()
            await _settled(pilot, app, lambda: True)
            start, start_cpu = time.perf_counter(), time.process_time()
            app._driver.send_message(events.Key("enter", "\r"))  # type: ignore[union-attr]
            await _settled(pilot, app, lambda: isinstance(app.screen, ResultsScreen))
            times["shown"].append(time.perf_counter() - start)
            await _settled(pilot, app, lambda: _screen_workers_done(app))
            times["drawn"].append(time.perf_counter() - start)
            times["cpu"].append(time.process_time() - start_cpu)
            widgets = len(list(app.screen.walk_children()))
            app._driver.send_message(events.Key("escape", "\x1b"))  # type: ignore[union-attr]
            await _settled(pilot, app, lambda: not isinstance(app.screen, ResultsScreen))
            await pilot.pause()
    return {"times": times, "widgets": widgets}


def _child(args: argparse.Namespace) -> None:
    import gc

    global POLL_S
    POLL_S = args.poll_ms / 1000
    gc.disable()  # as `gpuopt-tui` starts the app (cli.run_tui): the app turns the collector on after its first frame
    print(json.dumps(asyncio.run(_drive(args.run, args.rounds, args.think, args.warmed))))


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.0f} / {p95(values) * 1000:.0f}" if values else "n/a"


def median_ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.0f}" if values else "n/a"


def _package(tmp: Path, name: str, ref: str | None) -> Path:
    """A compiled copy of gpuopt_tui: this checkout's, or as committed at `ref`; returns the folder holding it."""
    root = tmp / name
    if ref is None:
        shutil.copytree(REPO / "gpuopt_tui", root / "gpuopt_tui", ignore=shutil.ignore_patterns("__pycache__"))
    else:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", ref, "gpuopt_tui"], capture_output=True, check=True
        )
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(root, filter="data")
    if not compileall.compile_dir(root / "gpuopt_tui", quiet=1):
        raise SystemExit(f"{root} did not compile")
    return root


def _run(args: argparse.Namespace, trees: dict[str, Path], tmp: Path) -> list[dict[str, object]]:
    results = []
    command = [sys.executable, __file__, "--rounds", str(args.rounds), "--think", str(args.think)]
    command += ["--poll-ms", str(args.poll_ms)]
    command += ["--warmed", "--child"] if args.warmed else ["--child"]
    lm_run = _lm_run(tmp) if LM_KIND in args.kinds else None
    for index in range(args.processes):
        for kind in args.kinds:
            names = list(trees) if index % 2 == 0 else list(reversed(trees))  # who goes first alternates
            for name in names:
                home = tmp / f"home-{name}-{kind}-{index}"
                shutil.copytree(FROZEN, home / "runs", ignore=shutil.ignore_patterns("README.md"))
                if kind == LM_KIND and lm_run is not None:
                    shutil.copytree(lm_run, home / "runs" / lm_run.name, copy_function=os.link)
                env = {
                    **os.environ,
                    "PYTHONPATH": str(trees[name]),
                    "GPUOPT_TUI_HOME": str(home),
                    "GPUOPT_TUI_RUNS_DIR": str(home / "runs"),
                    "OMP_NUM_THREADS": "1",
                }
                env.pop("TEXTUAL_ANIMATIONS", None)
                load = os.getloadavg()[0]
                done = subprocess.run(
                    [*command, kind, "--run", _run_name(kind)],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=args.timeout,
                    check=False,
                )
                if done.returncode != 0:
                    raise SystemExit(f"{name} {kind} process {index + 1} failed:\n{done.stderr[-3000:]}")
                result = json.loads(done.stdout.strip().splitlines()[-1])
                results.append({"tree": name, "kind": kind, "load": load, **result})
                shown = result["times"]["shown"]
                print(
                    f"{name} {kind} {index + 1}/{args.processes}: shown {[round(t * 1000) for t in shown]} ms, "
                    f"load {load:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
    return results


def _lm_run(tmp: Path) -> Path:
    """The causal LM run, written once into `tmp` (with this checkout's writers)."""
    from benchmarks.lm_results_run import write_lm_run

    start = time.perf_counter()
    run_dir = write_lm_run(tmp / "lm-run")
    size = sum(f.stat().st_size for f in (run_dir / "results").iterdir()) / 1024**2
    print(f"wrote {run_dir.name} ({size:.0f} MiB of results) in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return run_dir


def _checkout_label() -> str:
    """This checkout's commit, and whether its package differs from it."""
    git = ["git", "-C", str(REPO)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    dirty = subprocess.run([*git, "status", "--porcelain", "gpuopt_tui"], capture_output=True, text=True, check=False)
    return f"{head.stdout.strip() or 'this checkout'}{' + changes' if dirty.stdout.strip() else ''}"


def _versions() -> str:
    from importlib.metadata import version

    return f"Python {platform.python_version()}, textual {version('textual')}, rich {version('rich')}"


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return "load average " + "/".join(f"{v:.2f}" for v in os.getloadavg())


def report(args: argparse.Namespace, results: list[dict[str, object]], uptimes: tuple[str, str]) -> str:
    loads = [float(r["load"]) for r in results]  # type: ignore[arg-type]
    lines = [
        "# Opening a finished run's results from the Runs screen",
        "",
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; machine: {args.machine}, {os.cpu_count()} logical CPUs, "
        f"{platform.processor() or platform.machine()}; {_versions()}.",
        f"`uptime` at start: `{uptimes[0]}`; at end: `{uptimes[1]}`; 1-minute load before each process: "
        f"{min(loads):.2f}-{max(loads):.2f} (median {statistics.median(loads):.2f}).",
        f"Terminal 120x40 (headless Pilot); per kind and package, {args.processes} fresh processes x {args.rounds} "
        f"openings (the first of each process a first opening), {args.think:g} s after the runs were listed"
        + (" and the app's warm-up was done" if args.warmed else "")
        + (f"; waiting, each look at the app after a {args.poll_ms:g} ms sleep." if args.poll_ms else "."),
        f"Command: `{shlex.join(['python', 'benchmarks/results_view_latency.py', *args.argv])}`",
        f"Goal: {GOALS}. Definitions: the docstring of benchmarks/results_view_latency.py.",
        "",
        "| kind | package | widgets | first shown median / p95 ms | first drawn median / p95 ms | first CPU median ms "
        "| later shown median / p95 ms | later drawn median / p95 ms | later CPU median ms | later n |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind in args.kinds:
        for tree in dict.fromkeys(str(r["tree"]) for r in results):
            runs = [r for r in results if r["kind"] == kind and r["tree"] == tree]
            first = {k: [r["times"][k][0] for r in runs] for k in ("shown", "drawn", "cpu")}  # type: ignore[index]
            later = {k: [t for r in runs for t in r["times"][k][1:]] for k in ("shown", "drawn", "cpu")}  # type: ignore[index]
            lines.append(
                f"| {kind} | {tree} | {runs[-1]['widgets']} | {ms(first['shown'])} | {ms(first['drawn'])} "
                f"| {median_ms(first['cpu'])} | {ms(later['shown'])} | {ms(later['drawn'])} | {median_ms(later['cpu'])} "
                f"| {len(later['shown'])} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per kind (and package)")
    parser.add_argument("--rounds", type=int, default=4, help="openings per process")
    parser.add_argument("--think", type=float, default=0.0, help="seconds between the runs being listed and enter")
    parser.add_argument(
        "--warmed", action="store_true", help="open once the app's warm-up is done (then --think seconds more)"
    )
    parser.add_argument(
        "--poll-ms",
        type=float,
        default=0.0,
        help="sleep this long before each look at the app while waiting (0: look again at once, which keeps the UI "
        "thread busy and so takes the GIL from the app's reading threads half the time; an idle app's UI thread "
        "would not)",
    )
    parser.add_argument("--baseline", metavar="REF", help="also measure gpuopt_tui as committed at this git ref")
    parser.add_argument("--machine", default="2-core CPU, no GPU", help="how the results name the machine")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=KINDS, help="the kinds to measure")
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    if args.child:
        _child(args)
        return 0
    sys.path.insert(0, str(REPO))  # benchmarks.lm_results_run (a child imports only the package it measures)
    start = _uptime()
    with tempfile.TemporaryDirectory(prefix="results-view-latency-") as tmp:
        trees = {_checkout_label(): _package(Path(tmp), "checkout", None)}
        if args.baseline:
            trees = {f"{args.baseline} (baseline)": _package(Path(tmp), "baseline", args.baseline), **trees}
        results = _run(args, trees, Path(tmp))
    text = report(args, results, (start, _uptime()))
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
