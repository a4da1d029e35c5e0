"""A run's start-up profile: where the seconds went from its launch (`gpuopt-tui run`, `resume`, or the app's key)
to its first computed batch.

The run's process times its start-up as a chain of stages, each beginning where the one before ended, so that
they add up to the whole: the launch (the launching command reads the profile, creates the run directory and
starts the process), starting Python and the runner, importing torch and the engine, each stage the engine
announces (`JobContext.stage`: the model loader's imports, weights, tokenizer, device; the data; preparing), up to
the end of the first batch of the main count. It writes one `startup` event as each stage ends (`stage`,
`seconds`, `at`: seconds from the launch to the stage's end); the last, which ends where the first batch was
computed, also has `first_batch: true`, and none follows it. The launching process passes its launch time in
LAUNCHED_AT_ENV.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gpuopt_tui.core.runs.proc_files import seconds_running

LAUNCHED_AT_ENV = "GPUOPT_TUI_LAUNCHED_AT"  # unix time of the launch, set by core.runs.lifecycle.launch
LAUNCH_STAGE = "launching (profile, run directory, new process)"
WARM_LAUNCH_STAGE = "launching (profile, run directory, handed to a warm runner)"
WARM_STARTED_ENV = "GPUOPT_TUI_WARM_RUNNER"  # set in a run that a warm runner (core/runs/warm.py) took
PYTHON_STAGE = "starting Python and the runner (reading the profile)"
FIRST_BATCH = "to the first computed batch"  # the last stage's name ends with it, in parentheses
STALE_LAUNCH_S = 600.0  # a launch time this much before the process started was inherited, not this run's


@dataclass(frozen=True)
class StartupStage:
    name: str
    seconds: float
    at: float  # seconds from the launch to the end of the stage
    first_batch: bool = False  # the stage that ended with the first computed batch: start-up's last


class StartupClock:
    """Times a run's start-up stages and reports each as it ends through `emit("startup", ...)`."""

    def __init__(self, emit: Callable[..., Any], launched_at: float | None) -> None:
        self._emit = emit
        now = time.time()
        running = seconds_running()
        process_start = None if running is None else now - running
        self._origin = _origin(launched_at, process_start, now)
        self._since = self._origin
        self.done = False
        self._stage = PYTHON_STAGE
        self._launch_end: float | None = None  # reported with the first stage: the run's `started` comes first
        if self._origin == launched_at:
            if process_start is not None and process_start > launched_at:
                self._launch_end = process_start
            elif os.environ.get(WARM_STARTED_ENV):  # started long before the launch, its libraries imported
                self._stage = WARM_LAUNCH_STAGE
            else:  # where the process started is not known: the launch and the start are one stage
                self._stage = LAUNCH_STAGE

    def begin(self, name: str) -> None:
        """Stage `name` begins now: the stage before it ends (and is reported)."""
        if self.done or name == self._stage:
            return
        self._lap(self._stage, time.time())
        self._stage = name

    def first_batch(self) -> None:
        """The first batch of the main count is computed: the stage open now ends, and start-up with it (later
        calls do nothing)."""
        if not self.done:
            self._lap(f"{self._stage} ({FIRST_BATCH})", time.time(), first_batch=True)
            self.done = True

    def _lap(self, name: str, end: float, **extra: Any) -> None:
        if self._launch_end is not None:
            launch_end, self._launch_end = self._launch_end, None
            self._lap(LAUNCH_STAGE, launch_end)
        seconds = max(0.0, end - self._since)
        self._since = max(self._since, end)
        at = round(self._since - self._origin, 4)
        self._emit("startup", stage=name, seconds=round(seconds, 4), at=at, **extra)


def _origin(launched_at: float | None, process_start: float | None, now: float) -> float:
    """Where the profile starts: the launch when it is known and plausible, else the process's start, else now."""
    start = process_start if process_start is not None else now
    if launched_at is not None and start - STALE_LAUNCH_S <= launched_at <= now:
        return launched_at
    return start


def this_process_started() -> float:
    """When this process started (unix time; now where /proc cannot say): a command's launch time."""
    now = time.time()
    return now - (seconds_running() or 0.0)


def launched_at_from_env() -> float | None:
    """The launch time the launching process passed on; None when it did not (or passed no number)."""
    try:
        return float(os.environ[LAUNCHED_AT_ENV])
    except (KeyError, ValueError):
        return None


def startup_stages(events: Iterable[dict[str, Any]]) -> list[StartupStage]:
    """The start-up profile of the last attempt in `events` (the `startup` events after its `started`)."""
    stages: list[StartupStage] = []
    for event in events:
        if event["type"] == "started":
            stages = []
        elif event["type"] == "startup" and {"stage", "seconds", "at"} <= event.keys():
            last = event.get("first_batch") is True
            stages.append(StartupStage(event["stage"], event["seconds"], event["at"], last))
    return stages


def startup_headline(stages: list[StartupStage]) -> str:
    """A line such as "3.42 s from the launch to the first computed batch" (or "so far", while it starts)."""
    if not stages:
        return ""
    end = FIRST_BATCH if stages[-1].first_batch else f"so far (to the end of: {stages[-1].name})"
    return f"{stages[-1].at:.2f} s from the launch {end}"


def startup_lines(stages: list[StartupStage]) -> list[str]:
    """One line per stage: its seconds, its share of the whole and its name."""
    total = stages[-1].at if stages else 0.0
    return [f"{s.seconds:7.2f} s {_share(s.seconds, total):>4}  {s.name}" for s in stages]


def slowest(stages: list[StartupStage], count: int = 3) -> str:
    """The `count` longest stages, "name 1.23 s" each, longest first."""
    top = sorted(stages, key=lambda s: s.seconds, reverse=True)[:count]
    return ", ".join(f"{s.name} {s.seconds:.2f} s" for s in top)


def _share(seconds: float, total: float) -> str:
    return f"{100 * seconds / total:.0f}%" if total > 0 else "-"
