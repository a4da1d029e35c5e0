"""The layout of a run directory: the one place that names its files.

A run directory holds `meta.json` (what was launched), `profile.toml` (the frozen profile), `pid.json` (the
process of the current attempt), `events.jsonl` (see core.events), `log.txt` (the processes' output), `results/`
(what the run produced: each kind's file names are in its results module, e.g. core.attribution_results) and
`state/` (finished shards kept for resume); a run over several processes also `ranks/` (a JSON file per rank
saying how it ended), and `.lock` is held while a resume checks and launches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar


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
    STATE: ClassVar[str] = "state"
    RANKS: ClassVar[str] = "ranks"
    LOCK: ClassVar[str] = ".lock"
    FOLDERS: ClassVar[tuple[str, ...]] = (RESULTS, STATE)  # made with the directory
    OWN_FILES: ClassVar[tuple[str, ...]] = (LOG, PROFILE, EVENTS, META)  # beside results/, as a file list shows them

    @property
    def meta(self) -> Path:
        return self.path / self.META

    @property
    def profile(self) -> Path:
        return self.path / self.PROFILE

    @property
    def pid(self) -> Path:
        return self.path / self.PID

    @property
    def events(self) -> Path:
        return self.path / self.EVENTS

    @property
    def log(self) -> Path:
        return self.path / self.LOG

    @property
    def results(self) -> Path:
        return self.path / self.RESULTS

    @property
    def state(self) -> Path:
        return self.path / self.STATE

    @property
    def ranks(self) -> Path:
        """Where the workers of the current attempt leave how they ended, a JSON file per rank."""
        return self.path / self.RANKS

    def rank_report(self, rank: object) -> Path:
        return self.ranks / f"{rank}.json"

    @property
    def lock(self) -> Path:
        return self.path / self.LOCK
