"""Runs one run directory: loads its frozen profile, calls the kind's engine, reports through events.

Lifecycle events: `started` (pid, attempt), then exactly one of `finished` (with the engine's summary),
`failed` (a human message; the traceback goes to log.txt) or `cancelled` (after SIGTERM; shards that were
finished are kept for `resume`).

A run over several processes (see core/runs/distributed.py) is supervised from here: this process writes the
lifecycle events and waits for torchrun, whose workers (jobs/worker.py) report `rank_started`, then
`rank_finished`, `rank_failed` or `rank_cancelled`, each with its rank; the last also goes to `ranks/RANK.json`,
from which the outcome is decided.
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.kinds import KINDS
from gpuopt_tui.core.paths import cache_dir
from gpuopt_tui.core.profiles.common import ProfileBase
from gpuopt_tui.core.profiles.io import load_profile
from gpuopt_tui.core.runs.distributed import Scale, scale_of, torchrun_command, torchrun_env
from gpuopt_tui.core.runs.events import EventWriter, clean_event, read_events
from gpuopt_tui.core.runs.files import read_object
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.startup import StartupClock, launched_at_from_env
from gpuopt_tui.jobs.context import CUDA_STAGE, ENGINE_STAGE, TORCH_STAGE, JobCancelled, JobContext

CANCELLED = "cancelled on request; finished shards are kept for resume"
Outcome = tuple[str, dict[str, Any]]  # ("finished" | "failed" | "cancelled", the event's fields)
MODEL_KINDS = ("attribution", "tracin", "ablation")  # kinds whose engines put a model on the run's device
# Measured on the busy 2-core machine (load ~10): the demo attribution at 40-52 samples/s on one thread, 1.7-3.6 on two
DEMO_THREADS = (
    "the demo model runs on one CPU thread: it is too small to gain from more, and on a busy machine more threads "
    "make every small operation wait for a free core"
)


def _engine(kind: str) -> Any:
    return importlib.import_module(KINDS[kind].engine).run_job


def _set_up_device(profile: ProfileBase, ctx: JobContext) -> None:
    """On a GPU, CUDA started now, at a stage of its own; on the CPU, one thread for a demo model's runs."""
    import torch

    from gpuopt_tui.jobs.device import start_cuda

    if profile.kind in MODEL_KINDS and profile.run.device != "cpu" and torch.cuda.is_available():
        ctx.stage(CUDA_STAGE)
        start_cuda(profile.run.device)
    elif profile.kind in ("attribution", "tracin") and profile.model.adapter == "demo":  # the model is the work
        torch.set_num_threads(1)
        ctx.log(DEMO_THREADS)


def _memory_fields() -> Any:
    from gpuopt_tui.jobs.device import cuda_memory_fields

    return cuda_memory_fields


_importing = threading.Event()  # set while the engine's libraries load: a stop request then ends the run at once


def on_stop_signals(stop: Callable[[], None]) -> None:
    """SIGTERM and SIGINT ask to stop after the current chunk (at once while the libraries load: their import
    takes half a minute on a loaded machine, with nothing to save); SIGHUP (the terminal went away) is ignored."""

    def handler(signum: int, frame: object) -> None:
        print(f"[info] received signal {signum}: stopping after the current chunk", flush=True)
        stop()
        if _importing.is_set():
            raise JobCancelled

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # launch() starts the process with SIGTERM held back (core.runs.processes.stop_signal_held): one sent while it
    # started is taken now, by the handler
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def execute(profile: ProfileBase, ctx: JobContext) -> Outcome:
    """Run the profile's engine; expected problems become a message, unexpected ones a traceback in the log."""
    try:
        ctx.check_cancelled()  # cancelled while it started
        _importing.set()
        try:
            ctx.stage(TORCH_STAGE)
            import torch  # noqa: F401 (its seconds are a stage of their own)

            ctx.stage(ENGINE_STAGE)
            engine = _engine(profile.kind)
            ctx._memory_fields = _memory_fields()
        finally:
            _importing.clear()
        _set_up_device(profile, ctx)
        return "finished", {"summary": engine(profile, ctx) or {}}
    except JobCancelled:
        return "cancelled", {"message": CANCELLED}
    except UserError as e:
        print(f"[error] {e}", flush=True)
        return "failed", {"message": str(e)}
    except Exception as e:
        traceback.print_exc()
        sys.stdout.flush()
        return "failed", {"message": f"{type(e).__name__}: {e} (traceback in {RunDir.LOG})"}


EXIT_CODES = {"finished": 0, "failed": 1, "cancelled": 130}


def run(run_dir: Path) -> int:
    files = RunDir(run_dir)
    events = EventWriter(files.events)
    previous, _ = read_events(files.events, skim=True)  # only its `started` events count
    attempt = 1 + sum(1 for e in previous if e["type"] == "started")
    startup = StartupClock(events.emit, launched_at_from_env())
    ctx = JobContext(run_dir, events, cache_dir(), memory_fields=None, startup=startup)
    on_stop_signals(ctx.request_cancel)
    try:
        try:
            profile = load_profile(files.profile)
            scale = _on_this_node(scale_of(profile.run))
        except UserError as e:
            events.emit("failed", message=str(e))
            return 1
        started = {"pid": os.getpid(), "attempt": attempt, "kind": profile.kind, "host": socket.gethostname()}
        if scale.distributed:
            events.emit("started", **started, scale=scale.describe(), nodes=scale.nodes)
            outcome = supervise(run_dir, scale, ctx)
        else:
            events.emit("started", **started)
            print(f"[info] run {run_dir.name}: {profile.kind} '{profile.name}', attempt {attempt}", flush=True)
            outcome = execute(profile, ctx)
        events.emit(outcome[0], **outcome[1])
        return EXIT_CODES[outcome[0]]
    finally:
        events.sync()
        events.close()


def _on_this_node(scale: Scale) -> Scale:
    """devices = "all" on one node with at most one GPU is an ordinary one-process run."""
    if scale.nproc == "gpu" and scale.nodes == 1:
        import torch

        if torch.cuda.device_count() <= 1:
            return Scale()
    return scale


def supervise(run_dir: Path, scale: Scale, ctx: JobContext) -> Outcome:
    """Start torchrun for this node's workers, wait for it, and turn the ranks' reports into the outcome."""
    reports = RunDir(run_dir).ranks
    shutil.rmtree(reports, ignore_errors=True)  # an earlier attempt's
    cmd = torchrun_command(run_dir, scale)
    ctx.log(f"starting {scale.describe()}: {' '.join(cmd)}")
    if scale.nodes > 1:
        ctx.log(f"waiting for {scale.nodes - 1} more node(s): on each, run `gpuopt-tui join {run_dir}`")
    try:
        proc = subprocess.Popen(cmd, env=torchrun_env(scale), stdin=subprocess.DEVNULL)
    except OSError as e:
        return "failed", {"message": f"cannot start torchrun ({e.strerror or e})"}
    code = proc.wait()  # `cancel` signals torchrun too (same process group), which passes it on to the workers
    return outcome_of_ranks(_read_reports(reports), code, ctx.cancelled)


def _read_reports(folder: Path) -> list[dict[str, Any]]:
    """The ranks' reports; one that cannot be read or is not an event counts as missing (torchrun's exit code
    decides)."""
    found = []
    for path in sorted(folder.glob("*.json")):
        report, _ = read_object(path)
        if report is not None and isinstance(report.get("type"), str):
            found.append(clean_event(report))
    return found


def outcome_of_ranks(events: list[dict[str, Any]], code: int, cancel_requested: bool) -> Outcome:
    """The run's outcome from its workers' reports (their rank_* events) and torchrun's exit code."""
    failures = [e for e in events if e["type"] == "rank_failed"]
    if failures:
        first = min(failures, key=lambda e: e.get("t", 0.0))
        where = f"rank {first.get('rank')} on {first.get('host', '?')}"
        message = f"{where}: {first.get('message', '')}; finished shards are kept for resume"
        return "failed", {"message": message, "rank": first.get("rank")}
    finished = {e.get("rank"): e for e in events if e["type"] == "rank_finished"}
    if code == 0 and 0 in finished:
        return "finished", {"summary": finished[0].get("summary") or {}}
    if cancel_requested or any(e["type"] == "rank_cancelled" for e in events):
        return "cancelled", {"message": CANCELLED}
    return "failed", {"message": f"torchrun exited with code {code} before every rank finished; see {RunDir.LOG}"}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m gpuopt_tui.jobs RUN_DIR", file=sys.stderr)
        return 2
    return run(Path(argv[0]))
