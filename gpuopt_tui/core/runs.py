"""Runs: child processes that outlive the terminal, each with its own directory.

A run directory holds `meta.json` (what was launched), `profile.toml` (the frozen profile), `pid.json`
(the process of the current attempt), `events.jsonl`, `log.txt`, `results/` and `state/` (finished shards
kept for resume); a run over several processes also `ranks/` (how each of its workers ended). The status of
a run is derived from its last lifecycle event and whether its process is alive, so any process (the TUI after
a restart, `gpuopt-tui runs`) sees the same thing.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from gpuopt_tui.core.atomic import atomic_write_text
from gpuopt_tui.core.errors import ProfileError, UserError
from gpuopt_tui.core.events import TERMINAL_TYPES, EventTail, EventWriter
from gpuopt_tui.core.paths import runs_dir
from gpuopt_tui.core.profiles.common import ProfileBase
from gpuopt_tui.core.profiles.io import load_profile, profile_to_toml

ENGINE_MODULES = {
    "attribution": "attribution/job.py",
    "tracin": "tracin/job.py",
    "ablation": "ablation/job.py",
    "plan": "planjob.py",
}
LIFECYCLE = TERMINAL_TYPES | {"started"}
RANK_ENDS = frozenset(f"rank_{t}" for t in TERMINAL_TYPES)  # a rank's own end: rank_finished, rank_failed, ...
ACTIVE = frozenset({"starting", "running"})
RESUMABLE = frozenset({"cancelled", "failed", "crashed"})
_children: dict[int, subprocess.Popen[bytes]] = {}  # processes this process started, reaped when polled


def engine_available(kind: str) -> bool:
    """Whether this installation has an engine for `kind` (checked without importing it, so no torch)."""
    relative = ENGINE_MODULES.get(kind)
    return bool(relative) and (Path(__file__).resolve().parents[1] / "jobs" / relative).is_file()


@functools.cache
def this_host() -> str:
    return socket.gethostname()


# --- process liveness -----------------------------------------------------------------------------------------


def proc_start_time(pid: int) -> int | None:
    """Start time of a process in clock ticks since boot (Linux), None where /proc is not available."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state_and_rest = stat.rsplit(")", 1)[1].split()
    if state_and_rest[0] in ("Z", "X"):
        return -1  # a zombie: finished, waiting to be reaped
    return int(state_and_rest[19])


def pid_alive(pid: int, start_time: int | None = None) -> bool:
    """True while the process lives; a recorded start time guards against a reused pid."""
    child = _children.get(pid)
    if child is not None and child.poll() is not None:
        del _children[pid]
        return False
    current = proc_start_time(pid)
    if current == -1:
        return False
    if current is not None:
        return start_time is None or current == start_time
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- run records ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Worker:
    """One rank of a run over several processes, from its `rank_started` event."""

    rank: int
    pid: int
    host: str
    device: str
    start_time: int | None = None


def combined_progress(by_rank: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One progress for the ranks of a run: done, total and rate summed over the ranks at rank 0's stage
    (ranks elsewhere, e.g. rank 0 merging results alone, are left out), ETA of the slowest."""
    if not by_rank:
        return {}
    lead = by_rank.get(0) or by_rank[min(by_rank)]
    same = [p for p in by_rank.values() if (p.get("stage"), p.get("unit")) == (lead.get("stage"), lead.get("unit"))]
    rates = [p["rate"] for p in same if isinstance(p.get("rate"), (int, float))]
    etas = [p["eta"] for p in same if isinstance(p.get("eta"), (int, float))]
    return {
        **lead,
        "done": sum(p.get("done") or 0 for p in same),
        "total": sum(p.get("total") or 0 for p in same),
        "rate": sum(rates) if rates else None,
        "eta": max(etas) if etas else None,
        "ranks": len(same),
    }


def per_rank_progress(
    ranks: Iterable[int], by_rank: dict[int, dict[str, Any]], ends: dict[int, dict[str, Any]]
) -> dict[int, dict[str, Any]]:
    """Each rank's latest progress event (none before its first) with its `state`: "running" until its own end
    event, then "finished", "failed" or "cancelled", with that event's `message`."""
    return {
        rank: {
            **by_rank.get(rank, {}),
            "state": ends[rank]["type"].removeprefix("rank_") if rank in ends else "running",
            "message": str(ends[rank].get("message", "")) if rank in ends else "",
        }
        for rank in sorted({*ranks, *by_rank, *ends})
    }


@dataclass
class RunInfo:
    """A run as listed: identity, status and its latest progress."""

    id: str
    dir: Path
    kind: str
    name: str
    created: float
    status: str  # starting, running, finished, failed, cancelled, crashed, missing
    pid: int | None = None
    attempt: int = 0
    message: str = ""
    progress: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    ended: float | None = None
    corrupt_lines: int = 0
    started: float | None = None  # when the current attempt started (its `started` event), None before that
    artifacts: int = 0  # `artifact` events so far (of every attempt): grows as result files are written
    last_artifact: str = ""  # the newest artifact's path, relative to the run directory
    workers: tuple[Worker, ...] = ()  # the ranks of the current attempt of a run over several processes
    rank_progress: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> see per_rank_progress()

    host: str = ""  # where the run's process was started ("" when not recorded: this host)

    @property
    def remote(self) -> bool:
        """Started on another host (a run directory on a shared filesystem): its processes are not visible here."""
        return bool(self.host) and self.host != this_host()

    def pids(self) -> list[int]:
        """The run's process and, over several processes, its workers' on this host."""
        local = [w.pid for w in self.workers if w.host == this_host()]
        return ([self.pid] if self.pid and not self.remote else []) + local

    @property
    def active(self) -> bool:
        return self.status in ACTIVE

    @property
    def fraction(self) -> float | None:
        done, total = self.progress.get("done"), self.progress.get("total")
        if isinstance(done, (int, float)) and isinstance(total, (int, float)) and total > 0:
            return min(1.0, done / total)
        return None


class RunWatcher:
    """Keeps an incremental reader per run so repeated refreshes read only new events.

    Idle refreshes stay cheap with hundreds of runs: meta.json and pid.json are parsed again only when their
    stat changes, events.jsonl is opened only when it grew, and a finished run's process is not looked up.
    """

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or runs_dir()
        self._tails: dict[str, EventTail] = {}
        self._state: dict[str, dict[str, Any]] = {}
        self._files: dict[Path, tuple[tuple[int, int, int], dict[str, Any]]] = {}  # path -> (stat key, data)

    def run_dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.iterdir() if (p / "meta.json").is_file()), reverse=True)

    def refresh(self) -> list[RunInfo]:
        """All runs, newest first (by creation time: ids made in the same second differ only in a random part)."""
        reap_children()
        infos = sorted((self.info(d) for d in self.run_dirs()), key=lambda i: (i.created, i.id), reverse=True)
        live = {i.id for i in infos}
        for gone in set(self._tails) - live:
            run_dir = self._tails.pop(gone).path.parent
            self._state.pop(gone, None)
            for name in ("meta.json", "pid.json"):
                self._files.pop(run_dir / name, None)
        return infos

    def _json(self, path: Path) -> dict[str, Any] | None:
        """A JSON object file, parsed again only when its stat changes (run files are replaced whole, by atomic
        writes seconds apart); None when it is missing or unreadable."""
        try:
            st = path.stat()
        except OSError:
            self._files.pop(path, None)
            return None
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        cached = self._files.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        if not isinstance(data, dict):
            return None
        self._files[path] = (key, data)
        return data

    def _new_events(self, run_id: str, path: Path) -> Iterator[dict[str, Any]]:
        tail = self._tails.setdefault(run_id, EventTail(path))
        try:
            grown = path.stat().st_size != tail.offset
        except OSError:
            grown = False
        if grown:
            yield from tail.read()
            tail.events.clear()  # only the folded state is kept

    def info(self, run_dir: Path) -> RunInfo:
        run_id = run_dir.name
        meta = self._json(run_dir / "meta.json")
        if meta is None:
            return RunInfo(run_id, run_dir, "?", run_id, 0.0, "missing", message="run directory is gone or unreadable")
        state = self._state.setdefault(
            run_id,
            {
                "last": None,
                "progress": {},
                "attempt": 0,
                "summary": {},
                "started": None,
                "artifacts": 0,
                "artifact": "",
                "ranks": {},
                "rank_ends": {},
                "workers": {},
            },
        )
        for event in self._new_events(run_id, run_dir / "events.jsonl"):
            etype = event["type"]
            if etype == "progress":
                if "rank" in event:
                    state["ranks"][event["rank"]] = event
                    state["progress"] = combined_progress(state["ranks"])
                else:
                    state["progress"] = event
            elif etype == "rank_started":
                worker = Worker(
                    int(event.get("rank", -1)),
                    int(event.get("pid", 0)),
                    str(event.get("host", "")),
                    str(event.get("device", "")),
                    event.get("start_time"),
                )
                state["workers"][worker.rank] = worker
            elif etype in RANK_ENDS:
                state["rank_ends"][int(event.get("rank", -1))] = event
            elif etype == "artifact":
                state["artifacts"] += 1
                state["artifact"] = str(event.get("path", ""))
            elif etype in LIFECYCLE:
                state["last"] = event
                if etype == "started":
                    state["attempt"] = int(event.get("attempt", state["attempt"] + 1))
                    state["progress"] = {}
                    state["ranks"], state["rank_ends"], state["workers"] = {}, {}, {}
                    state["started"] = event.get("t")
                elif etype == "finished":
                    state["summary"] = event.get("summary") or {}
        info = RunInfo(
            id=run_id,
            dir=run_dir,
            kind=str(meta.get("kind", "?")),
            name=str(meta.get("name", run_id)),
            created=float(meta.get("created", 0.0)),
            status="starting",
            attempt=state["attempt"],
            progress=state["progress"],
            summary=state["summary"],
            corrupt_lines=self._tails[run_id].corrupt_lines,
            started=state["started"],
            artifacts=state["artifacts"],
            last_artifact=state["artifact"],
            workers=tuple(state["workers"][r] for r in sorted(state["workers"])),
            rank_progress=per_rank_progress(state["workers"], state["ranks"], state["rank_ends"]),
        )
        pid_info = self._json(run_dir / "pid.json") or {}
        info.pid = pid_info.get("pid")
        info.host = str(pid_info.get("host", ""))
        last = state["last"]
        ended = last is not None and last["type"] in TERMINAL_TYPES
        newer_attempt = pid_info.get("attempt", 0) > state["attempt"]  # resumed: its `started` is not written yet
        # the process of an attempt that reported its end is not looked up: that attempt is over either way; one
        # on another host cannot be looked up, and its events are all there is to go by
        alive = bool(info.pid) and (newer_attempt or not ended)
        alive = alive and (info.remote or pid_alive(int(info.pid), pid_info.get("start_time")))
        if ended and not (alive and newer_attempt):
            info.status = last["type"]
            info.message = str(last.get("message", ""))
            info.ended = last.get("t")
        elif alive or (not pid_info and time.time() - info.created < 10):
            info.status = "running" if last is not None else "starting"
        else:
            info.status = "crashed"
            info.message = "the run's process ended without reporting why; see its log"
        return info


def reap_children() -> None:
    """Collect the exit status of runs this process started that have ended (no zombies left behind)."""
    for pid, child in list(_children.items()):
        if child.poll() is not None:
            del _children[pid]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def find_run(run_id: str, root: Path | None = None) -> Path:
    """A run directory by id or unique id prefix."""
    root = root or runs_dir()
    exact = root / run_id
    if (exact / "meta.json").is_file():
        return exact
    matches = [p for p in RunWatcher(root).run_dirs() if p.name.startswith(run_id)] if run_id else []
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise UserError(f"run id {run_id!r} is ambiguous: {', '.join(p.name for p in matches[:5])}")
    raise UserError(f"no run {run_id!r} in {root} (see `gpuopt-tui runs`)")


def log_tail(run_dir: Path, lines: int = 20) -> list[str]:
    path = run_dir / "log.txt"
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:] if lines > 0 else []


# --- creating, launching, cancelling, resuming ----------------------------------------------------------------

_PATH_FIELD_NAMES = ("path", "config")
_PATH_LIST_NAMES = ("stages",)


@dataclass(frozen=True)
class _PathSlot:
    """Where one file path sits in a profile: `owner.attr`, or its item `index` when the field is a list."""

    owner: Any
    attr: str
    key: str  # dotted key as errors name it, e.g. "plan.stages[1]"
    index: int | None = None

    def get(self) -> str:
        value = getattr(self.owner, self.attr)
        return value if self.index is None else value[self.index]

    def set(self, path: str) -> None:
        if self.index is None:
            setattr(self.owner, self.attr, path)
        else:
            getattr(self.owner, self.attr)[self.index] = path


def _path_fields(obj: Any, prefix: str = "") -> list[_PathSlot]:
    """Every non-empty file path in a profile.

    Path fields are recognised by name: a string field named `path` or `config` or ending in `_path`, and each
    item of a list-of-strings field named `stages` or ending in `_paths`.
    """
    found: list[_PathSlot] = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        key = prefix + f.name
        if is_dataclass(value):
            found += _path_fields(value, f"{key}.")
        elif isinstance(value, list):
            is_path_list = f.name in _PATH_LIST_NAMES or f.name.endswith("_paths")
            for i, item in enumerate(value):
                if is_dataclass(item):
                    found += _path_fields(item, f"{key}[{i}].")
                elif is_path_list and isinstance(item, str) and item:
                    found.append(_PathSlot(obj, f.name, f"{key}[{i}]", i))
        elif isinstance(value, str) and value and (f.name in _PATH_FIELD_NAMES or f.name.endswith("_path")):
            found.append(_PathSlot(obj, f.name, key))
    return found


def resolve_paths(profile: ProfileBase, base: Path, source: str = "") -> None:
    """Make relative paths absolute (relative to the profile file's directory) and check that they exist."""
    for slot in _path_fields(profile):
        path = Path(slot.get()).expanduser()
        if not path.is_absolute():
            path = (base / path).resolve()
        slot.set(str(path))
        if not path.exists():
            raise ProfileError(source, slot.key, f"{path}: no such file or directory")
        if slot.key == "model.path" and not (path / "config.json").is_file():
            raise ProfileError(source, slot.key, f"{path}: expected a model directory with a config.json")


def create_run(profile: ProfileBase, source: Path | None = None, root: Path | None = None) -> Path:
    """Make a run directory with the frozen profile; returns it. Does not start the process."""
    if not engine_available(profile.kind):
        raise UserError(f"the '{profile.kind}' run kind has no engine in this version of gpuopt-tui")
    resolve_paths(profile, source.parent.resolve() if source else Path.cwd(), str(source or ""))
    root = root or runs_dir()
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{profile.kind}-{secrets.token_hex(2)}"
    run_dir = root / run_id
    try:
        run_dir.mkdir(parents=True)
        for sub in ("results", "state"):
            (run_dir / sub).mkdir()
    except OSError as e:
        raise UserError(
            f"cannot create the run directory {run_dir} ({e.strerror or e}); "
            "choose another with --runs-dir or GPUOPT_TUI_RUNS_DIR"
        ) from None
    meta = {
        "id": run_id,
        "kind": profile.kind,
        "name": profile.name or profile.kind,
        "created": time.time(),
        "source": str(source) if source else "",
    }
    atomic_write_text(run_dir / "profile.toml", profile_to_toml(profile))
    atomic_write_text(run_dir / "meta.json", json.dumps(meta, indent=2))
    return run_dir


def launch(run_dir: Path) -> int:
    """Start (or restart) the run's process in its own session; returns its pid."""
    attempt = int(_read_json(run_dir / "pid.json").get("attempt", 0)) + 1
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    try:
        with (run_dir / "log.txt").open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "gpuopt_tui.jobs", str(run_dir)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own session: SIGHUP / Ctrl-C of the terminal do not reach it
                cwd=run_dir,
                env=env,
            )
    except OSError as e:
        raise UserError(f"cannot start the run in {run_dir} ({e.strerror or e})") from None
    _children[proc.pid] = proc
    record = {"pid": proc.pid, "start_time": proc_start_time(proc.pid), "attempt": attempt, "host": this_host()}
    atomic_write_text(run_dir / "pid.json", json.dumps(record))
    return proc.pid


def start_run(profile: ProfileBase, source: Path | None = None, root: Path | None = None) -> Path:
    run_dir = create_run(profile, source, root)
    launch(run_dir)
    return run_dir


def cancel_run(run_dir: Path, force: bool = False) -> RunInfo:
    """Ask a running run to stop (SIGTERM to its process group); `force` kills it (SIGKILL)."""
    info = RunWatcher(run_dir.parent).info(run_dir)
    if not info.active or info.pid is None:
        raise UserError(f"run {info.id} is not running (it is {info.status})")
    if info.remote:
        raise UserError(f"run {info.id} runs on {info.host}; cancel it there: gpuopt-tui cancel {info.id}")
    sig = signal.SIGKILL if force else signal.SIGTERM
    try:
        os.killpg(info.pid, sig)
    except ProcessLookupError:
        raise UserError(f"run {info.id} has already stopped") from None
    except PermissionError:
        raise UserError(f"run {info.id} belongs to another user; cannot signal pid {info.pid}") from None
    _signal_workers(info, sig)
    if force:
        events = EventWriter(run_dir / "events.jsonl")
        events.emit("cancelled", message="killed (SIGKILL); shards finished before were kept")
        events.close()
    return info


def _signal_workers(info: RunInfo, sig: signal.Signals) -> None:
    """torchrun starts each worker in a session of its own, out of reach of the run's process group: on this
    host they are signalled one by one (a killed torchrun could not pass a signal on)."""
    for worker in info.workers:
        if worker.host == this_host() and worker.pid and pid_alive(worker.pid, worker.start_time):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(worker.pid, sig)


def active_run_pids(infos: Iterable[RunInfo]) -> dict[int, str]:
    """pid -> run id for the processes of every active run (for matching GPU processes to runs)."""
    return {pid: info.id for info in infos if info.active for pid in info.pids()}


def resume_run(run_dir: Path) -> int:
    """Restart a cancelled, failed or crashed run; its engine skips the shards already finished."""
    info = RunWatcher(run_dir.parent).info(run_dir)
    if info.status not in RESUMABLE:
        raise UserError(f"run {info.id} is {info.status}; only cancelled, failed or crashed runs can be resumed")
    load_profile(run_dir / "profile.toml")  # fail early and clearly if the frozen profile is unreadable
    return launch(run_dir)


def delete_run(run_dir: Path) -> None:
    info = RunWatcher(run_dir.parent).info(run_dir)
    if info.active:
        raise UserError(f"run {info.id} is still running; cancel it first")
    shutil.rmtree(run_dir, ignore_errors=True)


def wait_for(run_dir: Path, statuses: frozenset[str], timeout: float) -> RunInfo:
    """Poll until the run reaches one of `statuses` or `timeout` seconds pass; returns the last info."""
    watcher = RunWatcher(run_dir.parent)
    deadline = time.monotonic() + timeout
    while True:
        info = watcher.info(run_dir)
        if info.status in statuses or time.monotonic() > deadline:
            return info
        time.sleep(0.1)
