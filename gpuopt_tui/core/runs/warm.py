"""Warm runners: processes that have imported torch, transformers and the engines before a run starts, so that a run
handed to one starts computing without waiting for its libraries (seconds: benchmarks/results/run_startup_*.md).

Opt-in. `gpuopt-tui --warm` keeps one while the TUI is open; `gpuopt-tui warm` keeps one for the runs that
`gpuopt-tui run` starts (scripts, other terminals) for --minutes, and with `--model DIR` it also reads that model's
weights ahead (jobs/models/preloaded.py). Either is replaced by a new one after each run it takes, and ends by
itself when its time is up or the TUI that keeps it has gone (checked every second).

A warm runner lives in `warm_dir()/PID/`: `socket`, where a run is handed over, and `ready.json` (its pid, start
time, key, owner, expiry, whether to replace it, the model directories it read), written once its imports are done.
`launch` (lifecycle.py) takes a ready one whose key equals its own: the same Python, the same gpuopt-tui code and
the same environment variables of those that change what torch, transformers and the engines do
(WARM_ENV_PREFIXES); one that read the run's model comes first; with none, the run starts a process of its own as
before. The hand-over: connect, send the run directory and the launching environment, and receive the runner's pid
and start time once it has taken the run (its output then goes to the run's log and its working directory is the
run's: core.runs.processes verifies a warm-served run by that). A runner accepts one connection and then closes its
socket, so only one launch can take it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.paths import data_dir
from gpuopt_tui.core.runs.files import read_object
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.processes import JOB_MODULE, NEUTRAL_CWD, WARM_FLAG, adopt, pid_alive, run_env
from gpuopt_tui.core.runs.startup import LAUNCHED_AT_ENV, WARM_STARTED_ENV

READY = "ready.json"
SOCKET = "socket"
HANDOVER_TIMEOUT_S = 5.0
REPLACEMENT_DELAY_S = 5.0  # a replacement waits this long before its imports: the run it follows starts first
WARM_START_DELAY_S = 3.0  # the TUI's first one waits for the screens' warm-up after the first frame
# Environment variables read when torch, transformers or the engines are imported (thread counts, CUDA and NCCL
# settings, caches and offline modes, gpuopt-tui's own): a runner serves only launches whose values are its own.
WARM_ENV_PREFIXES = ("CUDA", "NCCL", "NVIDIA", "PYTORCH", "TORCH", "HF_", "TRANSFORMERS", "TOKENIZERS", "OMP_",
                     "MKL", "OPENBLAS", "GPUOPT_TUI", "PYTHON", "LD_", "XDG_", "HOME")  # fmt: skip


PER_LAUNCH_ENV = (LAUNCHED_AT_ENV, WARM_STARTED_ENV)  # set for each launch: not part of the key


def warm_dir() -> Path:
    return data_dir() / "warm"


def runner_key(env: dict[str, str]) -> str:
    """What a warm runner and a launch must share: Python, gpuopt-tui's code, the environment that matters."""
    package = Path(__file__).resolve().parents[2]
    code = sorted((str(p.relative_to(package)), p.stat().st_mtime_ns) for p in package.rglob("*.py"))
    wanted = sorted((k, v) for k, v in env.items() if k.startswith(WARM_ENV_PREFIXES) and k not in PER_LAUNCH_ENV)
    text = json.dumps([sys.executable, code, wanted])  # the run's sys.path follows from these (PYTHONPATH)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class WarmRunner:
    """A ready warm runner, as its ready.json says."""

    folder: Path
    pid: int
    start_time: int | None
    key: str
    owner: int | None
    replace: bool
    minutes: float
    models: tuple[str, ...] = ()  # model directories it read ahead (jobs/models/preloaded.py)


def ready_runners() -> list[WarmRunner]:
    """The warm runners that are ready now (their process alive), oldest first."""
    found = []
    with contextlib.suppress(OSError):
        for folder in sorted(warm_dir().iterdir(), key=lambda p: p.name):
            record, _ = read_object(folder / READY)
            runner = _runner(folder, record)
            if runner is not None and pid_alive(runner.pid, runner.start_time):
                found.append(runner)
            elif runner is not None:  # killed before it could tidy up
                shutil.rmtree(folder, ignore_errors=True)
    return found


def _runner(folder: Path, record: dict[str, Any] | None) -> WarmRunner | None:
    try:
        assert record is not None
        owner = record.get("owner")
        return WarmRunner(folder, int(record["pid"]), record.get("start_time"), str(record["key"]),
                          None if owner is None else int(owner), bool(record.get("replace")),
                          float(record.get("minutes", 0)), tuple(map(str, record.get("models", ()))))  # fmt: skip
    except (AssertionError, KeyError, TypeError, ValueError):
        return None


def start_warm_runner(
    *,
    owner: int | None,
    minutes: float,
    replace: bool,
    delay: float = 0.0,
    env: dict[str, str] | None = None,
    models: tuple[str, ...] = (),
) -> int:
    """Start a warm runner in its own session (it outlives the terminal, as runs do); its pid. `owner`: the pid of
    the process that keeps it (it ends when that one has), None for one kept for `minutes` only; `models`: model
    directories whose weights it reads ahead."""
    command = [sys.executable, "-m", JOB_MODULE, WARM_FLAG, "--minutes", repr(minutes), "--delay", repr(delay)]
    for model in models:
        command += ["--model", str(Path(model).expanduser().resolve())]
    if owner is not None:
        command += ["--owner", str(owner)]
    if replace:
        command.append("--replace")
    warm_dir().mkdir(mode=0o700, parents=True, exist_ok=True)  # its sockets hand runs over: this user only
    proc = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        cwd=NEUTRAL_CWD,
        env=run_env(env),
    )
    adopt(proc)
    return proc.pid


def take_warm_runner(run_dir: Path, env: dict[str, str]) -> tuple[int, int | None] | None:
    """Hand the run in `run_dir` to a ready warm runner of this launch's key; (its pid, start time), or None when
    none is ready or none took it. A runner that wanted a replacement gets one."""
    runners = ready_runners()
    if not runners:  # the usual case: nothing to compare the key with
        return None
    key = runner_key(env)
    model = _model_of(run_dir)
    # one that read the run's model ahead first, then one that read none (it holds no other model's memory)
    for runner in sorted(runners, key=lambda r: (model not in r.models, bool(r.models))):
        if runner.key != key:
            continue
        taken = _hand_over(runner, run_dir, env)
        if taken is None:
            continue
        if runner.replace:
            with contextlib.suppress(OSError):
                start_warm_runner(owner=runner.owner, minutes=runner.minutes, replace=True,
                                  delay=REPLACEMENT_DELAY_S, env=env, models=runner.models)  # fmt: skip
        return taken
    return None


def _model_of(run_dir: Path) -> str | None:
    """The model directory of the run's frozen profile (made absolute when the run was created), if it names one."""
    from gpuopt_tui.core.profiles.io import parse_toml, read_text

    try:
        model = parse_toml(read_text(RunDir(run_dir).profile), str(run_dir)).get("model", {})
    except (OSError, UserError):
        return None
    path = model.get("path") if isinstance(model, dict) else None
    return str(Path(path).expanduser().resolve()) if isinstance(path, str) and path else None


def _hand_over(runner: WarmRunner, run_dir: Path, env: dict[str, str]) -> tuple[int, int | None] | None:
    message = json.dumps({"run_dir": str(run_dir.resolve()), "env": env}).encode() + b"\n"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(HANDOVER_TIMEOUT_S)
            conn.connect(str(runner.folder / SOCKET))
            conn.sendall(message)
            reply = json.loads(conn.makefile("rb").readline() or b"null")
    except (OSError, ValueError):
        return None
    if not isinstance(reply, dict) or reply.get("pid") != runner.pid:
        return None
    return runner.pid, reply.get("start_time")


def stop_warm_runners(owner: int | None = None) -> list[int]:
    """Stop the ready warm runners (those `owner` keeps, when given); their pids."""
    stopped = []
    for runner in ready_runners():
        if owner is not None and runner.owner != owner:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(runner.pid, signal.SIGTERM)
            stopped.append(runner.pid)
    return stopped
