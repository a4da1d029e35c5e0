"""What a run is doing, read from its directory: status, progress and workers, folded from its events.

The status of a run is derived from its last lifecycle event and whether its process is alive, so any process
(the TUI after a restart, `gpuopt-tui runs`) sees the same thing. A run whose files cannot be used is listed as
"damaged", with the reason; it never stops the others from being listed.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuopt_tui.core.format import safe_text
from gpuopt_tui.core.paths import runs_dir
from gpuopt_tui.core.runs.events import LIFECYCLE_TYPES, RANK_END_TYPES, TERMINAL_TYPES, EventTail
from gpuopt_tui.core.runs.files import crash_message, meta_problem, pid_record_problem, read_object
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.processes import pid_alive, reap_children

ACTIVE = frozenset({"starting", "running"})
RESUMABLE = frozenset({"cancelled", "failed", "crashed"})


@functools.cache
def this_host() -> str:
    return socket.gethostname()


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
    (ranks elsewhere, e.g. rank 0 merging results alone, are left out), ETA of the slowest. A stage without a
    count (loading the model) stays without one."""
    if not by_rank:
        return {}
    lead = by_rank.get(0) or by_rank[min(by_rank)]
    same = [p for p in by_rank.values() if (p.get("stage"), p.get("unit")) == (lead.get("stage"), lead.get("unit"))]
    rates = [p["rate"] for p in same if isinstance(p.get("rate"), (int, float))]
    etas = [p["eta"] for p in same if isinstance(p.get("eta"), (int, float))]
    counts = {
        "done": sum(p.get("done") or 0 for p in same),
        "total": sum(p.get("total") or 0 for p in same),
    }
    return {
        **lead,
        **(counts if "total" in lead else {}),
        "rate": sum(rates) if rates else None,
        "eta": max(etas) if etas else None,
        "ranks": len(same),
    }


def stage_text(progress: dict[str, Any]) -> str:
    """What a progress event says the run is doing: its stage, with the epoch where it reports one (probes
    train for epochs before their count moves); "" when it names none."""
    stage = str(progress.get("stage") or "")
    epoch = progress.get("epoch")
    if stage and isinstance(epoch, int) and not isinstance(epoch, bool):
        return f"{stage}, epoch {epoch}"
    return stage


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
    """A run as listed: identity, status and its latest progress. Text read from the run's files is safe to show."""

    id: str
    dir: Path
    kind: str
    name: str
    created: float
    status: str  # starting, running, finished, failed, cancelled, crashed, damaged, missing
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
    pid_start_time: int | None = None  # the run's process's start time, as recorded when it was started
    orphans: tuple[int, ...] = ()  # a crashed run's workers on this host that are still alive

    @property
    def remote(self) -> bool:
        """Started on another host (a run directory on a shared filesystem): its processes are not visible here."""
        return bool(self.host) and self.host != this_host()

    def pids(self) -> list[int]:
        """The run's process and, over several processes, its workers' on this host."""
        return ([self.pid] if self.pid and not self.remote else []) + [w.pid for w in self.local_workers()]

    def local_workers(self) -> list[Worker]:
        return [w for w in self.workers if w.host == this_host()]

    @property
    def active(self) -> bool:
        return self.status in ACTIVE

    @property
    def fraction(self) -> float | None:
        done, total = self.progress.get("done"), self.progress.get("total")
        if isinstance(done, (int, float)) and isinstance(total, (int, float)) and total > 0:
            return min(1.0, done / total)
        return None


def _fresh_state() -> dict[str, Any]:
    return {
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
    }


def _fold(state: dict[str, Any], event: dict[str, Any]) -> None:
    """Fold one event (fields of the right type: see events.clean_event) into a run's state."""
    etype = event["type"]
    if etype == "progress":
        if "rank" in event:
            state["ranks"][event["rank"]] = event
            state["progress"] = combined_progress(state["ranks"])
        else:
            state["progress"] = event
    elif etype == "rank_started":
        rank = event.get("rank", -1)
        state["workers"][rank] = Worker(
            rank, event.get("pid", 0), event.get("host", ""), event.get("device", ""), event.get("start_time")
        )
    elif etype in RANK_END_TYPES:
        state["rank_ends"][event.get("rank", -1)] = event
    elif etype == "artifact":
        state["artifacts"] += 1
        state["artifact"] = event.get("path", "")
    elif etype in LIFECYCLE_TYPES:
        state["last"] = event
        if etype == "started":
            state["attempt"] = event.get("attempt", state["attempt"] + 1)
            state["progress"] = {}
            state["ranks"], state["rank_ends"], state["workers"] = {}, {}, {}
            state["started"] = event.get("t")
        elif etype == "finished":
            state["summary"] = event.get("summary", {})


class RunWatcher:
    """Keeps an incremental reader per run so repeated refreshes read only new events.

    Idle refreshes stay cheap with hundreds of runs: meta.json and pid.json are parsed again only when their
    stat changes, events.jsonl is opened only when it grew, and a finished run's process is not looked up.
    A run whose files cannot be used is listed as "damaged", with the reason; it never stops the others.
    """

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or runs_dir()
        self._tails: dict[str, EventTail] = {}
        self._state: dict[str, dict[str, Any]] = {}
        self._files: dict[Path, tuple[tuple[int, int, int], tuple[dict[str, Any] | None, str]]] = {}

    def run_dirs(self) -> list[Path]:
        """The run directories: those with a meta.json (or one that cannot be looked at, listed as damaged).
        OSError when the runs directory itself cannot be read."""
        found = []
        try:
            with os.scandir(self.root) as entries:
                for entry in entries:
                    try:
                        if not entry.is_dir():
                            continue
                        os.stat(os.path.join(entry.path, RunDir.META))
                    except (FileNotFoundError, NotADirectoryError):
                        continue
                    except OSError:
                        pass  # there may be a run, which info() reports as damaged
                    found.append(Path(entry.path))
        except FileNotFoundError:
            return []
        return sorted(found, reverse=True)

    def refresh(self) -> list[RunInfo]:
        """All runs, newest first (by creation time: ids made in the same second differ only in a random part)."""
        reap_children()
        infos = sorted((self.info(d) for d in self.run_dirs()), key=lambda i: (i.created, i.id), reverse=True)
        live = {i.id for i in infos}
        for gone in set(self._tails) - live:
            files = RunDir(self._tails.pop(gone).path.parent)
            self._state.pop(gone, None)
            for path in (files.meta, files.pid):
                self._files.pop(path, None)
        return infos

    def _json(self, path: Path) -> tuple[dict[str, Any] | None, str]:
        """A JSON object file (see runs.files.read_object), parsed again only when its stat changes (run files are
        replaced whole, by atomic writes seconds apart)."""
        try:
            st = path.stat()
        except OSError:
            self._files.pop(path, None)
            return read_object(path)
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        cached = self._files.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        read = read_object(path)
        self._files[path] = (key, read)
        return read

    def _new_events(self, run_id: str, path: Path) -> Iterator[dict[str, Any]]:
        tail = self._tails.setdefault(run_id, EventTail(path, skim=True))
        try:
            grown = path.stat().st_size != tail.offset
        except OSError:
            grown = False
        if grown:
            yield from tail.read()
            tail.events.clear()  # only the folded state is kept

    def info(self, run_dir: Path) -> RunInfo:
        run_id, files = run_dir.name, RunDir(run_dir)
        meta, problem = self._json(files.meta)
        if meta is None and not problem:
            return RunInfo(run_id, run_dir, "?", run_id, 0.0, "missing", message="run directory is gone")
        problem = problem or meta_problem(meta or {})
        if meta is None or problem:
            kind = meta.get("kind") if meta and isinstance(meta.get("kind"), str) else "?"
            return RunInfo(run_id, run_dir, safe_text(kind), run_id, 0.0, "damaged", message=problem)
        state = self._state.setdefault(run_id, _fresh_state())
        for event in self._new_events(run_id, files.events):
            _fold(state, event)
        tail = self._tails[run_id]
        info = RunInfo(
            id=run_id,
            dir=run_dir,
            kind=safe_text(meta["kind"]),
            name=safe_text(meta.get("name", run_id)),
            created=float(meta["created"]),
            status="starting",
            attempt=state["attempt"],
            progress=state["progress"],
            summary=state["summary"],
            corrupt_lines=tail.corrupt_lines,
            started=state["started"],
            artifacts=state["artifacts"],
            last_artifact=state["artifact"],
            workers=tuple(state["workers"][r] for r in sorted(state["workers"])),
            rank_progress=per_rank_progress(state["workers"], state["ranks"], state["rank_ends"]),
        )
        record, problem = self._json(files.pid)
        problem = tail.error or problem or pid_record_problem(record or {})
        if problem:
            info.status, info.message = "damaged", problem
            return info
        self._set_status(info, state["last"], record or {})
        return info

    def _set_status(self, info: RunInfo, last: dict[str, Any] | None, record: dict[str, Any]) -> None:
        """Status from the last lifecycle event and whether the process of pid.json (checked) lives."""
        info.pid = record.get("pid")
        info.pid_start_time = record.get("start_time")
        info.host = safe_text(record.get("host", ""))
        ended = last is not None and last["type"] in TERMINAL_TYPES
        newer_attempt = record.get("attempt", 0) > info.attempt  # resumed: its `started` is not written yet
        # the process of an attempt that reported its end is not looked up: that attempt is over either way; one
        # on another host cannot be looked up, and its events are all there is to go by
        alive = bool(info.pid) and (newer_attempt or not ended)
        alive = alive and (info.remote or pid_alive(info.pid, info.pid_start_time))
        if ended and not (alive and newer_attempt):
            assert last is not None
            info.status = last["type"]
            info.message = last.get("message", "")
            info.ended = last.get("t")
        elif alive or (not record and 0 <= time.time() - info.created < 10):  # just created: not launched yet
            info.status = "running" if last is not None else "starting"
        else:
            info.status = "crashed"
            info.message = crash_message(info.dir)
            info.orphans = tuple(w.pid for w in info.local_workers() if pid_alive(w.pid, w.start_time))
            if info.orphans:
                info.message += (
                    f"; {len(info.orphans)} of its worker processes are still running "
                    f"(`gpuopt-tui cancel {info.id}` stops them)"
                )
