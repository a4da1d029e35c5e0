"""Regenerate screenshots/*.svg: every screen of the app at 120x40, showing real runs, and the ablation
screen's run pane at 80x24 (where the form and the run pane take turns).

The runs are made the way a user makes them, with the CLI, in a data directory of their own: the demo
profile of each kind that has an engine runs to the end; one run is given a model directory copied without
its weights (it fails, and says why); one is cancelled part way; one long run over two processes is left going
while the screenshots are taken (and cancelled afterwards). Every number on the screenshots comes from those
runs, from this machine, or from a recorded GPU trace: by default the GPU panel and the GPU screen replay
tests/fixtures/traces/h200_ig_bench.jsonl (NVML samples recorded on an NVIDIA H200 while the IG benchmark ran),
held at its busiest sample with the samples before it in the history plots; their captions say so.

usage: python screenshots/generate.py [--out DIR] [--data DIR] [--replay TRACE [--replay-start N] | --live]
                                      [--keep-runs]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpuopt_tui.app import make_app
from gpuopt_tui.core.atomic import atomic_write_text
from gpuopt_tui.core.kinds import engine_available
from gpuopt_tui.core.runs.events import read_events
from gpuopt_tui.core.runs.lifecycle import find_run
from gpuopt_tui.core.telemetry.replay import Trace, read_trace
from gpuopt_tui.ui.gpu_telemetry import GpuTelemetry, busiest_sample
from gpuopt_tui.ui.screens.registry import SCREENS

SIZE = (120, 40)
NARROW = (80, 24)
HERE = Path(__file__).resolve().parent
LONG_RUN = ("--set", "attribution.n_steps=8000", "--set", "attribution.batch_size=1")
TWO_PROCESSES = ("--set", "run.device=cpu", "--set", "run.devices=2")  # torchrun, two CPU processes
H200_TRACE = HERE.parent / "tests" / "fixtures" / "traces" / "h200_ig_bench.jsonl"
H200_CAPTION = "GPU: replay of NVML samples recorded on an NVIDIA H200 during the IG benchmark"
GPU_SCREENS = ("dashboard", "gpu")  # the screens that show the GPUs


def cli(*args: str, check: bool = True) -> str:
    """Run `gpuopt-tui ARGS` as a user would; returns its output."""
    done = subprocess.run([sys.executable, "-m", "gpuopt_tui", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise SystemExit(f"gpuopt-tui {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def wait_for_progress(run_id: str, done: int, timeout: float = 300.0) -> None:
    """Until the run reports at least `done` units of work finished."""
    events = find_run(run_id) / "events.jsonl"
    deadline = time.monotonic() + timeout
    while max((e.get("done", 0) for e in read_events(events)[0] if e["type"] == "progress"), default=0) < done:
        if time.monotonic() > deadline:
            raise SystemExit(f"run {run_id} did not reach {done} done within {timeout:.0f} s")
        time.sleep(0.5)


def make_runs(data: Path) -> str | None:
    """Runs in every state the screens show; returns the id of the one left running (if an engine exists)."""
    for kind in ("plan", "tracin", "ablation", "attribution"):
        if engine_available(kind):
            print(f"running demo-{kind} to the end…", flush=True)
            cli("run", f"demo-{kind}")
    if not engine_available("attribution"):
        return None
    print("running demo-attribution-lm to the end…", flush=True)
    cli("run", "demo-attribution-lm")
    print("a run on a model directory copied without its weights…", flush=True)
    partial = data / "models" / "bert-partial-copy"
    partial.mkdir(parents=True, exist_ok=True)
    (partial / "config.json").write_text('{"model_type": "bert", "num_labels": 2}\n', encoding="utf-8")
    cli(
        "run", "demo-attribution", "--set", "name=partial-model", "--set", "model.adapter=hf",
        "--set", f"model.path={partial}", check=False,
    )  # fmt: skip
    print("a run cancelled part way…", flush=True)
    cancelled = cli("run", "demo-attribution", "--set", "name=cancelled-demo", *LONG_RUN, "--detach").split()[-1]
    wait_for_progress(cancelled, 2)
    cli("cancel", cancelled)
    print("a long run over two processes left going…", flush=True)
    running = cli("run", "demo-attribution", "--set", "name=long-demo", *LONG_RUN, *TWO_PROCESSES, "--detach")
    running = running.split()[-1]
    wait_for_progress(running, 2)
    return running


def gpu_caption(trace: Trace | None) -> str:
    if trace is None:
        return "GPU: this machine's NVML"
    return H200_CAPTION if trace.path.resolve() == H200_TRACE else f"GPU: replay of {trace.path.name}"


def save(app: Any, out: Path, name: str, caption: str) -> None:
    atomic_write_text(out / name, app.export_screenshot(title=caption))


async def shoot(out: Path, trace: Trace | None, start: int, gpu_caption: str) -> None:
    """Every screen; the GPUs from `trace` (held at sample `start`), or from this machine's NVML."""

    async def settle(pilot: Any) -> None:
        await pilot.pause(1.5)  # a few polls of runs and GPUs
        await pilot.app.workers.wait_for_complete()
        await pilot.pause(0.3)

    for spec in SCREENS:
        telemetry = None if trace is None else GpuTelemetry.from_trace(trace, start, start + 1, speed=None, loop=False)
        caption = f"gpuopt-tui · {gpu_caption}" if spec.name in GPU_SCREENS else "gpuopt-tui"
        app = make_app(screen=spec.name, telemetry=telemetry)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            if spec.name == "planner":
                await pilot.press("ctrl+e")
                await settle(pilot)
            save(app, out, f"{spec.name}.svg", caption)
            if spec.name == "runs":
                failed = next((r for r in app.runs.runs if r.status == "failed"), None)
                if failed is not None:
                    app.screen.select_run(failed.id)  # type: ignore[attr-defined]
                    await settle(pilot)
                    save(app, out, "runs-failed.svg", caption)
        print(f"  {spec.name}", flush=True)
    async with make_app(screen="runs").run_test(size=SIZE) as pilot:
        await settle(pilot)
        lm = next((r for r in pilot.app.runs.runs if r.name == "demo-attribution-lm" and r.status == "finished"), None)
        if lm is not None:
            pilot.app.open_results(lm.id)
            await settle(pilot)
            pilot.app.screen.view.focus_first()  # the sample table (tab, tab from the tab bar)
            await pilot.press("full_stop")  # the completion's first token
            await settle(pilot)
            save(pilot.app, out, "attribution-lm.svg", "gpuopt-tui")
            print("  a causal LM's results, per completion token", flush=True)
    async with make_app(screen="ablation").run_test(size=NARROW) as pilot:
        await settle(pilot)
        await pilot.press("ctrl+l")  # the run pane
        await settle(pilot)
        save(pilot.app, out, "ablation-80x24.svg", "gpuopt-tui at 80x24")
    print("  ablation at 80x24", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE, help="where the SVGs go (default: screenshots/)")
    parser.add_argument(
        "--data", type=Path, default=Path("/tmp/gpuopt-tui-screenshots"), help="data directory for the runs"
    )
    gpu = parser.add_mutually_exclusive_group()
    gpu.add_argument(
        "--replay",
        type=Path,
        default=H200_TRACE,
        help="a GPU trace recorded with `gpuopt-tui gpu --record` (default: the H200 trace in tests/fixtures)",
    )
    gpu.add_argument("--live", action="store_true", help="show this machine's GPUs instead of a trace")
    parser.add_argument(
        "--replay-start",
        type=int,
        help="the sample of the trace shown; those before it fill the history plots "
        "(default: the busiest: most memory in use, weighted by SM utilisation)",
    )
    parser.add_argument("--keep-runs", action="store_true", help="reuse the runs already in --data")
    args = parser.parse_args()
    trace = None if args.live else read_trace(args.replay)
    start = 0
    if trace is not None:
        start = busiest_sample(trace) if args.replay_start is None else args.replay_start
        if not 0 <= start < len(trace.snapshots):
            parser.error(f"--replay-start {start}: {args.replay} has samples 0 to {len(trace.snapshots) - 1}")
    os.environ["GPUOPT_TUI_HOME"] = str(args.data.resolve())
    os.environ.pop("GPUOPT_TUI_RUNS_DIR", None)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runs = args.data / "runs"
    running = None
    if not args.keep_runs:
        shutil.rmtree(runs, ignore_errors=True)
        shutil.rmtree(args.data / "config", ignore_errors=True)
        shutil.rmtree(args.data / "models", ignore_errors=True)
        running = make_runs(args.data)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        asyncio.run(shoot(args.out, trace, start, gpu_caption(trace)))
    finally:
        if running is not None:
            cli("cancel", running, check=False)
    print(f"screenshots in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
