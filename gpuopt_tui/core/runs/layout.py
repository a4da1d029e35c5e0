"""The layout of a run directory: the one place that names its files.

A run directory holds `meta.json` (what was launched), `profile.toml` (the frozen profile), `pid.json` (the
process of the current attempt), `events.jsonl` (see core.runs.events), `log.txt` (the processes' output), `results/`
(what the run produced: each kind's file names are in its results module, e.g. core.results.attribution) and
`state/` (finished shards kept for resume); a run over several processes also `ranks/` (a JSON file per rank
saying how it ended), and `.lock` is held while a resume checks and launches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar


def _inside(name: str) -> property:
    """A path in the run directory, as a property of RunDir."""
    return property(lambda self: self.path / name, doc=f"The run's {name}.")


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory's files (nothing is read or created here)."""

    path: Path

    META: ClassVar[str] = "meta.json"
    PROFILE: ClassVar[str] = "profile.toml"
    PID: ClassVar[str] = "pid.json"
    EVENTS: ClassVar[str] = "events.jsonl"
    LOG: ClassVar[str] = "log.txt"
    RESULTS: ClassVar[str] = "results"
    SUMMARY: ClassVar[str] = "summary.json"  # in results/: every kind's short summary of a finished run
    STATE: ClassVar[str] = "state"
    RANKS: ClassVar[str] = "ranks"  # where the workers of the current attempt leave how they ended
    LOCK: ClassVar[str] = ".lock"
    FOLDERS: ClassVar[tuple[str, ...]] = (RESULTS, STATE)  # made with the directory
    OWN_FILES: ClassVar[tuple[str, ...]] = (LOG, PROFILE, EVENTS, META)  # beside results/, as a file list shows them

    meta = _inside(META)
    profile = _inside(PROFILE)
    pid = _inside(PID)
    events = _inside(EVENTS)
    log = _inside(LOG)
    results = _inside(RESULTS)
    summary = property(lambda self: self.results / self.SUMMARY, doc="The run's results/summary.json.")
    state = _inside(STATE)
    ranks = _inside(RANKS)
    lock = _inside(LOCK)

    def rank_report(self, rank: object) -> Path:
        """How the worker of `rank` ended (its last event), a file of its own."""
        return self.ranks / f"{rank}.json"
