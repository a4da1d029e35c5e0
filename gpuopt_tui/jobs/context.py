"""What an engine gets from the runner: events, cancellation, shards for resume, directories.

Kept free of torch so that it can be imported and tested anywhere; the runner plugs in a callable that adds
GPU memory figures to progress events.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from gpuopt_tui.core.atomic import write_atomically
from gpuopt_tui.core.caches.features import file_sha256
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.runs.events import EventWriter
from gpuopt_tui.core.runs.files import shown
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.startup import StartupClock

RESUME_RECORD = "resume.json"
CHECKSUMS = "checksums"  # in the state directory: a file per shard, written once the shard is whole (`_checksum`)
_MISSING = object()
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_.]{1,40}")
T = TypeVar("T")

# Stages that several kinds of run go through (see JobContext.stage); each engine names its own others.
TORCH_STAGE = "importing torch"  # seconds, before anything else can happen
ENGINE_STAGE = "importing the engine"
CUDA_STAGE = "starting CUDA (driver and context)"
LOAD_STAGE = "loading the model"
PREPARE_STAGE = "preparing the engine"  # settings, parameters, the resume record
WRITE_STAGE = "writing results"


class StageFn(Protocol):
    """Says what a run is doing now (see `JobContext.stage`); engines and model loaders take one."""

    def __call__(self, name: str, done: int | None = None, total: int | None = None, unit: str = "steps") -> None: ...


def no_stage(name: str, done: int | None = None, total: int | None = None, unit: str = "steps") -> None:
    """A StageFn that tells no one (for callers outside a run)."""


@dataclass(frozen=True)
class ResumePart:
    """One thing a run's shards depend on: its `value` as the resume record keeps it, `what` it is and `where`
    the profile names it ("" for settings, whose changed keys a refusal lists), for the refusal's message."""

    value: Any
    what: str
    where: str = ""


class JobCancelled(Exception):
    """Raised by `JobContext.check_cancelled` once a cancel request (SIGTERM) has arrived."""


class Collective:
    """What the processes of one run do together. This one is a single process; a run over several
    (torchrun) gets jobs.collective.TorchCollective with the same methods."""

    rank = 0
    world_size = 1

    def barrier(self) -> None:
        """Wait until every process got here."""

    def gather(self, obj: T) -> list[T] | None:
        """Every process's `obj`, in rank order, on rank 0; None elsewhere."""
        return [obj]

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj`, on every process."""
        return obj


class JobContext:
    def __init__(
        self,
        run_dir: Path,
        events: EventWriter,
        cache_dir: Path,
        memory_fields: Callable[[], dict[str, Any]] | None = None,
        dist: Collective | None = None,
        startup: StartupClock | None = None,
    ) -> None:
        self.run_dir = run_dir
        layout = RunDir(run_dir)
        self.results_dir, self.state_dir = layout.results, layout.state
        self.cache_dir = cache_dir
        for d in (self.results_dir, self.state_dir):
            d.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # a cache folder that cannot be made: each cache says so when used
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.events = events
        self._memory_fields = memory_fields or dict
        self._cancel = threading.Event()
        self._rate_window: list[tuple[float, int]] = []
        self._stage = ""
        self._last_of_stage: dict[str, dict[str, Any]] = {}  # stage -> the fields of its last progress
        self.dist = dist or Collective()
        self._startup = startup  # times the stages up to the first batch (core/runs/startup.py); None: not timed
        self._record_digest = ""  # of the resume record: each shard's checksum file names it
        self._intact: set[str] = set()  # shards whose checksum was checked

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def world_size(self) -> int:
        return self.dist.world_size

    # -- cancellation -------------------------------------------------------------------------------------
    def request_cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def check_cancelled(self) -> None:
        if self._cancel.is_set():
            raise JobCancelled

    # -- events --------------------------------------------------------------------------------------------
    def event(self, type: str, **fields: Any) -> None:
        self.events.emit(type, **fields)

    def log(self, message: str, level: str = "info") -> None:
        print(f"[{level}] {message}", flush=True)
        if self.rank == 0:  # the other ranks of a run over several processes say the same: the log only
            self.events.emit("log", level=level, message=message)

    def warn(self, message: str) -> None:
        print(f"[warning] {message}", flush=True)
        self.events.emit("warning", message=message)

    def metric(self, name: str, value: Any, **extra: Any) -> None:
        self.events.emit("metric", name=name, value=value, **extra)

    def artifact(self, path: Path, description: str) -> None:
        rel = os.path.relpath(path, self.run_dir)
        self.events.emit("artifact", path=rel, description=description)

    def progress(self, done: int, total: int, *, unit: str = "samples", stage: str = "", **extra: Any) -> None:
        """Report progress; throttled to a few events a second, but the last step (done == total) and the
        first event of a new stage are always written."""
        now = time.monotonic()
        window = self._rate_window
        if window and done < window[-1][1]:  # a count that starts again (a new stage): a new rate
            window.clear()
        window.append((now, done))
        while len(window) > 2 and now - window[0][0] > 30.0:  # rate over the last ~30 s
            window.pop(0)
        t0, d0 = window[0]
        rate = (done - d0) / (now - t0) if now > t0 and done > d0 else None
        eta = (total - done) / rate if rate else None
        fields = {"done": done, "total": total, "unit": unit, "rate": rate, "eta": eta, **extra}
        if stage:
            fields["stage"] = stage
        self._last_of_stage[stage] = fields
        new_stage = stage != self._stage
        if new_stage:
            self._enter(stage)
        self.events.progress(force=done >= total or new_stage, **fields, **self._memory_fields())

    def stage(self, name: str, done: int | None = None, total: int | None = None, unit: str = "steps") -> None:
        """Say what the run is doing now: a progress event with this `stage`, written at once when the stage is
        new. With `done`/`total` it is progress like `progress` (rate and ETA counted from the stage's start);
        without, a stage that has no count (loading the model, writing results): its event has no done/total.
        A run says its main count again (`repeat_progress`) as it ends, so that run lists show it rather than
        the last stage's."""
        if done is not None and total is not None:
            if self._stage != name:
                self.reset_rate()
            self.progress(done, total, unit=unit, stage=name)
        elif self._stage != name:
            self._enter(name)
            self.events.progress(force=True, stage=name, **self._memory_fields())

    def _enter(self, name: str) -> None:
        self._stage = name
        if self._startup is not None and name:
            self._startup.begin(name)

    def first_batch_done(self) -> None:
        """Say that the first batch of the run's main count is computed: start-up ends there (its profile's last
        stage, see core/runs/startup.py). Engines call it after every batch; only the first call counts."""
        if self._startup is not None:
            self._startup.first_batch()

    def cancellable_stage(
        self, name: str, done: int | None = None, total: int | None = None, unit: str = "steps"
    ) -> None:
        """`stage`, first raising JobCancelled if a cancel has arrived: the StageFn for work after the main count
        (the check, the audit), so that a cancel stops it too."""
        self.check_cancelled()
        self.stage(name, done, total, unit)

    def repeat_progress(self, stage: str) -> None:
        """Write the last progress of `stage` again, as it was (rate included)."""
        if stage in self._last_of_stage:
            self._stage = stage
            self.events.progress(force=True, **self._last_of_stage[stage], **self._memory_fields())

    def reset_rate(self) -> None:
        """Forget rate history, e.g. when a new stage with a different unit starts."""
        self._rate_window.clear()

    # -- shards (finished pieces of work kept for resume) ----------------------------------------------------
    def shard_path(self, name: str) -> Path:
        return self.state_dir / name

    def shard_done(self, name: str) -> bool:
        """Whether the shard was saved whole, under this name and this run's resume record (see `_checksum`;
        checked once per process). A shard that is damaged, renamed, saved under another record or whose save did
        not end is not done, and is made again."""
        if name not in self._intact:
            try:
                check = json.loads(self._checksum_path(name).read_text(encoding="utf-8"))
                intact = check == self._checksum(name, file_sha256(self.shard_path(name)))
            except (OSError, ValueError, RecursionError):
                intact = False
            if not intact:
                return False
            self._intact.add(name)
        return True

    def finished_shards(self) -> list[str]:
        return sorted(p.name for p in self.state_dir.iterdir() if p.is_file() and self.shard_done(p.name))

    def save_shard(self, name: str, write: Callable[[Path], None]) -> Path:
        """Call `write(tmp_path)`, then move the file into place atomically and write its checksum file: a shard
        exists whole or not at all."""
        final = self.shard_path(name)
        digest: list[str] = []

        def write_and_hash(tmp: Path) -> None:
            write(tmp)
            digest.append(file_sha256(tmp))

        write_atomically(final, write_and_hash)
        check = json.dumps(self._checksum(name, digest[0]))
        self._checksum_path(name).parent.mkdir(exist_ok=True)
        write_atomically(self._checksum_path(name), lambda tmp: tmp.write_text(check, encoding="utf-8"))
        self._intact.add(name)
        return final

    def delete_shard(self, name: str) -> None:
        self._intact.discard(name)
        self._checksum_path(name).unlink(missing_ok=True)
        self.shard_path(name).unlink(missing_ok=True)

    def _checksum_path(self, name: str) -> Path:
        return self.state_dir / CHECKSUMS / f"{name}.json"

    def _checksum(self, name: str, sha256: str) -> dict[str, str]:
        """What a shard's checksum file holds: the shard's name (a shard renamed is not the one named), the
        resume record it was saved under and its bytes' SHA-256."""
        return {"name": name, "record": self._record_digest, "sha256": sha256}

    def check_resume_record(self, parts: Mapping[str, ResumePart]) -> None:
        """Keep what shaped this run's shards (settings, digests of the data, weights and tokenizer); a resume
        with anything else is refused, naming what changed, since mixing shards made from different inputs would
        give wrong results. Shards are saved under the record (see shard_done). Over several processes, rank 0
        checks and the others wait for it."""
        record = json.loads(json.dumps({key: part.value for key, part in parts.items()}, default=str))
        self._record_digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()
        self._intact.clear()
        if self.rank == 0:
            self._check_record(record, parts)
        self.dist.barrier()

    def _check_record(self, record: dict[str, Any], parts: Mapping[str, ResumePart]) -> None:
        path = self.shard_path(RESUME_RECORD)
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            write_atomically(path, lambda tmp: tmp.write_text(json.dumps(record), encoding="utf-8"))
            return
        except (OSError, ValueError, RecursionError) as e:
            raise UserError(f"resume refused: the resume record {path} cannot be read ({e}): start a new run") from None
        if not isinstance(saved, dict):
            raise UserError(f"resume refused: the resume record {path} is damaged: start a new run")
        if saved != record:
            raise UserError(refusal(saved, record, parts))


def refusal(saved: dict[str, Any], record: dict[str, Any], parts: Mapping[str, ResumePart]) -> str:
    """Why a resume is refused: what changed since the run started, and where (the profile key, or the
    settings' old and new values)."""
    if missing := [key for key in record if key not in saved]:
        without = _few([parts[key].what for key in missing], ", ")
        return f"resume refused: an older gpuopt-tui wrote the resume record (without {without}): start a new run"
    changed = [key for key in record if saved[key] != record[key]]
    whats = [parts[key].what for key in changed] + [f"the {_key(key)}" for key in saved if key not in record]
    details = [parts[key].where or _difference(saved.get(key), record[key]) for key in changed]
    where = "; ".join(d for d in details if d)
    return f"resume refused: {_few(whats, ' and ')} changed since the run started" + (
        f" ({where}): start a new run" if where else ": start a new run"
    )


def _difference(old: Any, new: Any) -> str:
    """The keys whose values differ, "key: old -> new", where both are JSON objects."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return ""
    keys = [k for k in dict.fromkeys([*new, *old]) if old.get(k, _MISSING) != new.get(k, _MISSING)]
    return _few([f"{_key(k)}: {shown(old.get(k))} -> {shown(new.get(k))}" for k in keys], ", ")


def _key(key: str) -> str:
    """A key of the saved record (which may have been damaged), as a message names it."""
    return key if _PLAIN_KEY.fullmatch(key) else shown(key)


def _few(items: list[str], joiner: str, limit: int = 3) -> str:
    return joiner.join(items[:limit]) + (f" (+{len(items) - limit} more)" if len(items) > limit else "")
