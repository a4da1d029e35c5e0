"""Runs one run directory: loads its frozen profile, calls the kind's engine, reports through events.

Lifecycle events: `started` (pid, attempt), then exactly one of `finished` (with the engine's summary),
`failed` (a human message; the traceback goes to log.txt) or `cancelled` (after SIGTERM; shards that were
finished are kept for `resume`).
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.events import EventWriter, read_events
from gpuopt_tui.core.paths import cache_dir
from gpuopt_tui.core.profiles.io import load_profile
from gpuopt_tui.core.runs import ENGINE_MODULES
from gpuopt_tui.jobs.context import JobCancelled, JobContext


def _engine(kind: str) -> Any:
    module = "gpuopt_tui.jobs." + ENGINE_MODULES[kind].removesuffix(".py").replace("/", ".")
    return importlib.import_module(module).run_job


def _memory_fields() -> Any:
    from gpuopt_tui.jobs.device import cuda_memory_fields

    return cuda_memory_fields


def run(run_dir: Path) -> int:
    events = EventWriter(run_dir / "events.jsonl")
    previous, _ = read_events(run_dir / "events.jsonl")
    attempt = 1 + sum(1 for e in previous if e["type"] == "started")
    ctx = JobContext(run_dir, events, cache_dir(), memory_fields=None)

    def on_signal(signum: int, frame: object) -> None:
        print(f"[info] received signal {signum}: stopping after the current chunk", flush=True)
        ctx.request_cancel()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        profile = load_profile(run_dir / "profile.toml")
        events.emit("started", pid=os.getpid(), attempt=attempt, kind=profile.kind, host=socket.gethostname())
        print(f"[info] run {run_dir.name}: {profile.kind} '{profile.name}', attempt {attempt}", flush=True)
        engine = _engine(profile.kind)
        ctx._memory_fields = _memory_fields()
        summary = engine(profile, ctx)
        events.emit("finished", summary=summary or {})
        return 0
    except JobCancelled:
        events.emit("cancelled", message="cancelled on request; finished shards are kept for resume")
        return 130
    except UserError as e:
        print(f"[error] {e}", flush=True)
        events.emit("failed", message=str(e))
        return 1
    except Exception as e:
        traceback.print_exc()
        sys.stdout.flush()
        events.emit("failed", message=f"{type(e).__name__}: {e} (traceback in log.txt)")
        return 1
    finally:
        events.sync()
        events.close()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m gpuopt_tui.jobs RUN_DIR", file=sys.stderr)
        return 2
    return run(Path(argv[0]))
