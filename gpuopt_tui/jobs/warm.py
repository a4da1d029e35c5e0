"""`python -m gpuopt_tui.jobs --warm ...`: a warm runner (core/runs/warm.py says what it is and how a run reaches it).

It imports what a run's start-up imports (torch, transformers' model machinery, tokenizers, safetensors, the
engines), never CUDA (a context would hold GPU memory while it waits, and the run may be given other devices),
writes ready.json, and waits for one run. Given one, it takes the launch's environment, the run's log as its output
and the run directory as its working directory, and is that run's process from then on (jobs/runner.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

from gpuopt_tui.core.atomic import write_json
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.processes import pid_alive, proc_start_time
from gpuopt_tui.core.runs.startup import WARM_STARTED_ENV
from gpuopt_tui.core.runs.warm import READY, SOCKET, runner_key, warm_dir

ACCEPT_POLL_S = 1.0  # how often a waiting runner checks its owner and its time


def _import_libraries() -> None:
    import safetensors.torch  # noqa: F401
    import tokenizers  # noqa: F401
    import torch  # noqa: F401
    import transformers
    import transformers.modeling_utils  # most of transformers' import time

    from gpuopt_tui.jobs.runner import MODEL_KINDS, _engine

    for name in ("AutoConfig", "AutoTokenizer", "AutoModelForSequenceClassification", "AutoModelForCausalLM"):
        getattr(transformers, name)
    for kind in MODEL_KINDS:
        _engine(kind)


def _preload(folders: list[Path]) -> None:
    """Read the weights of each model directory now (jobs/models/preloaded.py); one that cannot be read is left to
    the run, which reports why."""
    from gpuopt_tui.jobs.models.preloaded import preload

    for folder in folders:
        try:
            preload(folder)
        except Exception as exc:  # the run on it meets the same error and says it in its own words
            print(f"[warn] {folder}: not read ahead: {exc}", file=sys.stderr, flush=True)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gpuopt_tui.jobs --warm")
    parser.add_argument("--warm", action="store_true", required=True)
    parser.add_argument("--minutes", type=float, required=True, help="end when idle this long (0: only the owner)")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds to wait before the imports")
    parser.add_argument("--owner", type=int, help="end when this process has")
    parser.add_argument("--replace", action="store_true", help="the launch that takes it starts another")
    parser.add_argument("--model", action="append", default=[], type=Path, help="a model directory to read ahead")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit)  # `warm --stop`, the TUI quitting: tidy up on the way out
    expires = time.time() + 60 * args.minutes if args.minutes > 0 else None
    start = time.monotonic()
    while time.monotonic() - start < args.delay:  # the owner may go meanwhile (the TUI quit)
        if not _wanted(args.owner, expires):
            return 0
        time.sleep(min(ACCEPT_POLL_S / 5, args.delay))
    if not _wanted(args.owner, expires):
        return 0
    started_env = dict(os.environ)  # the key's: the imports set variables of their own (TORCHINDUCTOR_CACHE_DIR)
    _import_libraries()
    _preload(args.model)
    set_by_imports = {k: v for k, v in os.environ.items() if k not in started_env}
    folder = warm_dir() / str(os.getpid())
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(str(folder / SOCKET))
            listener.listen(1)
            listener.settimeout(ACCEPT_POLL_S)
            write_json(folder / READY, _record(args, expires, runner_key(started_env)))
            conn = _wait(listener, args.owner, expires)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # no launch finds it any more
    if conn is None:
        return 0
    with conn:
        run_dir = _take(conn, set_by_imports)
    if run_dir is None:
        return 0
    from gpuopt_tui.jobs.runner import run

    return run(run_dir)


def _exit(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _record(args: argparse.Namespace, expires: float | None, key: str) -> dict[str, object]:
    pid = os.getpid()
    return {"pid": pid, "start_time": proc_start_time(pid), "key": key, "owner": args.owner,
            "replace": args.replace, "minutes": args.minutes, "expires": expires,
            "models": [str(m) for m in args.model]}  # fmt: skip


def _wanted(owner: int | None, expires: float | None) -> bool:
    return (owner is None or pid_alive(owner)) and (expires is None or time.time() < expires)


def _wait(listener: socket.socket, owner: int | None, expires: float | None) -> socket.socket | None:
    """The one connection that hands a run over; None when the owner has gone or the time is up first."""
    while _wanted(owner, expires):
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(10.0)
        return conn
    return None


def _take(conn: socket.socket, set_by_imports: dict[str, str]) -> Path | None:
    """Become the run's process: its environment (the launch's, and what the imports set where it sets nothing, as
    in a process started for the run), output and working directory; tell the launch so."""
    try:
        message = json.loads(conn.makefile("rb").readline())
        run_dir, env = Path(message["run_dir"]), dict(message["env"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # taken by the runner's handler (as in launch())
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(set_by_imports | env | {WARM_STARTED_ENV: "1"})
    os.chdir(run_dir)  # how a cancel verifies this process (core.runs.processes); imports are done
    with open(RunDir(run_dir).log, "ab") as log:
        for fd in (1, 2):
            os.dup2(log.fileno(), fd)
    pid = os.getpid()
    try:  # a launch that does not hear back starts a process of its own: then this one must not run
        conn.sendall(json.dumps({"pid": pid, "start_time": proc_start_time(pid)}).encode() + b"\n")
    except OSError:
        return None
    return run_dir
