"""Following a run from the terminal: rich progress with rate, ETA and GPU memory, until it ends."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, Task, TaskID, TextColumn, TimeElapsedColumn
from rich.progress_bar import ProgressBar
from rich.text import Text

from gpuopt_tui.core.format import human_bytes, human_duration, safe_text
from gpuopt_tui.core.runs.events import TERMINAL_TYPES, EventTail
from gpuopt_tui.core.runs.files import log_tail
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.lifecycle import cancel_run
from gpuopt_tui.core.runs.startup import StartupStage, slowest, startup_headline, startup_stages
from gpuopt_tui.core.runs.status import RunInfo, RunWatcher, combined_progress, stage_text

POLL_S = 0.25
console = Console(stderr=True, highlight=False)


def _counted(task: Task) -> bool:
    """Whether the task's stage has a count (rich keeps the last total when told none: a field says it)."""
    return task.total is not None and bool(task.fields.get("counted", True))


class StageBarColumn(BarColumn):
    """The bar; it pulses through a stage without a count."""

    def render(self, task: Task) -> ProgressBar:
        bar = super().render(task)
        if not _counted(task):
            bar.total, bar.pulse = None, True
        return bar


class CountColumn(MofNCompleteColumn):
    """done/total, or nothing for a stage without a count."""

    def render(self, task: Task) -> Text:
        return super().render(task) if _counted(task) else Text()


def _stats(event: dict[str, Any]) -> str:
    parts = []
    unit = event.get("unit", "items")
    if event.get("rate"):
        parts.append(f"{event['rate']:.1f} {unit}/s")
    if event.get("eta") is not None:
        parts.append(f"ETA {human_duration(event['eta'])}")
    if event.get("gpu_reserved"):
        parts.append(f"GPU {human_bytes(event['gpu_reserved'])} (peak {human_bytes(event.get('gpu_peak', 0))})")
    return "  ".join(parts)


def new_progress(name: str) -> tuple[Progress, TaskID]:
    """The follow view of run `name`: its stage, a bar, done/total, time elapsed, rate, ETA and GPU memory."""
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        StageBarColumn(),
        CountColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[stats]}"),
        console=console,
        transient=False,
    )
    return progress, progress.add_task(name, total=None, stats="starting…", counted=False)


def show_progress(progress: Progress, task: TaskID, event: dict[str, Any], name: str) -> None:
    """Show a progress event: the stage it names (else the run's `name`) and its count, where it has one."""
    progress.update(
        task,
        description=escape(stage_text(event) or name),
        completed=event.get("done", 0),
        total=event.get("total"),
        counted="total" in event,
        stats=escape(_stats(event)),
    )


def print_outcome(run_dir: Path, event: dict[str, Any], startup: list[StartupStage] | None = None) -> int:
    """Print how a run ended (with its start-up's slowest stages, `startup`); returns the CLI exit code for it."""
    kind = event["type"]
    if kind == "finished":
        console.print(f"[green]finished[/] {run_dir.name}")
        if startup:
            console.print(f"  start-up: {startup_headline(startup)}; slowest: {slowest(startup)}", markup=False)
        for key, value in (event.get("summary") or {}).items():
            if isinstance(value, float):
                console.print(f"  {safe_text(key)}: {value:.4g}", markup=False)
            elif not isinstance(value, (dict, list)):
                console.print(f"  {safe_text(key)}: {safe_text(value)}", markup=False)
        console.print(f"  results: {RunDir(run_dir).results}")
        return 0
    if kind == "cancelled":
        console.print(f"[yellow]cancelled[/] {run_dir.name}: {escape(str(event.get('message', '')))}")
        console.print(f"  resume with: gpuopt-tui resume {run_dir.name}")
        return 130
    console.print(f"[red]failed[/] {run_dir.name}: {escape(str(event.get('message', '')))}")
    tail = log_tail(run_dir, 15)
    if tail:
        console.print(f"  last lines of {RunDir.LOG}:")
        for line in tail:
            console.print(f"    {line}", markup=False)
    return 1


def _gone(info: RunInfo) -> int | None:
    """The exit code when the run can no longer be followed (its directory deleted or damaged), else None."""
    if info.status == "missing":
        console.print(
            f"[red]gone[/] {info.id}: its run directory {escape(str(info.dir))} was deleted; stopped following"
        )
        return 1
    if info.status == "damaged":
        console.print(f"[red]damaged[/] {info.id}: {escape(info.message)}; stopped following")
        return 1
    return None


def follow(run_dir: Path, *, cancel_on_interrupt: bool, since: int = 0) -> int:
    """Show progress until the run ends. Ctrl-C cancels the run (run/resume) or only detaches (attach). `since`:
    the events file's size before a resume, so that only the new attempt's events are shown."""
    follower = _Follower(run_dir, cancel_on_interrupt, since)
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, follower.on_interrupt)
    try:
        with follower.progress:
            return follower.run()
    except KeyboardInterrupt:
        if cancel_on_interrupt:
            cancel_run(run_dir, force=True)
            console.print(f"[red]killed[/]: finished shards were kept; resume with gpuopt-tui resume {run_dir.name}")
            return 130
        console.print(f"detached; the run goes on. Re-attach with: gpuopt-tui attach {run_dir.name}")
        return 0
    finally:
        signal.signal(signal.SIGINT, previous)


class _Follower:
    """Following one run: its events drawn as they come (see EVENT_HANDLERS), its status checked after each read."""

    def __init__(self, run_dir: Path, cancel_on_interrupt: bool, since: int = 0) -> None:
        self.run_dir, self.cancel_on_interrupt = run_dir, cancel_on_interrupt
        self.tail = EventTail(RunDir(run_dir).events, skim=True, offset=since)
        self.watcher = RunWatcher(run_dir.parent)
        self.progress, self.task = new_progress(run_dir.name)
        self.interrupted = False
        self.outcome: dict[str, Any] | None = None  # a terminal event counts only if no later attempt started after it
        self.ranks: dict[int, dict[str, Any]] = {}  # latest progress of each rank of a run over several processes
        self.startup: list[dict[str, Any]] = []  # the current attempt's `startup` events

    def run(self) -> int:
        """Draw the run's events until it ends; returns the exit code."""
        while True:
            for event in self.tail.read():
                handler = EVENT_HANDLERS.get(event["type"])
                if handler is not None:
                    handler(self, event)
            code = self.exit_code(self.watcher.info(self.run_dir))
            if code is not None:
                return code
            time.sleep(POLL_S)

    def exit_code(self, info: RunInfo) -> int | None:
        """The exit code once the run has ended or can no longer be followed, else None."""
        gone = _gone(info)
        if gone is not None:
            self.progress.stop()
            return gone
        if self.outcome is not None and not info.active:
            self.progress.stop()
            code = print_outcome(self.run_dir, self.outcome, startup_stages(self.startup))
            # a cancel that this command asked for exits 130; one from elsewhere is a failure to the caller
            return 1 if code == 130 and not self.interrupted else code
        if info.status == "crashed":
            self.progress.stop()
            return print_outcome(self.run_dir, {"type": "failed", "message": info.message})
        return None

    def on_interrupt(self, signum: int, frame: object) -> None:
        if self.interrupted or not self.cancel_on_interrupt:
            raise KeyboardInterrupt
        self.interrupted = True
        console.print("[yellow]cancelling: the run stops after its current chunk (Ctrl-C again to kill it)[/]")
        try:
            cancel_run(self.run_dir)
        except Exception as e:  # the run may have just ended by itself
            console.print(f"  {e}")

    def on_started(self, event: dict[str, Any]) -> None:
        self.outcome, self.ranks, self.startup = None, {}, []
        attempt = f"attempt {event.get('attempt', 1)} on {event.get('host', '')}"
        self.progress.update(self.task, stats=escape(attempt))

    def on_progress(self, event: dict[str, Any]) -> None:
        if "rank" in event:
            self.ranks[event["rank"]] = event
            event = combined_progress(self.ranks)
        show_progress(self.progress, self.task, event, self.run_dir.name)

    def on_message(self, event: dict[str, Any]) -> None:
        style = "yellow" if event["type"] == "warning" else "dim"
        where = f"rank {event['rank']}: " if event.get("rank") else ""
        self.progress.console.print(f"{where}{event.get('message', '')}", style=style, markup=False)

    def on_rank_failed(self, event: dict[str, Any]) -> None:
        message = f"rank {event.get('rank')} failed: {event.get('message', '')}"
        self.progress.console.print(message, style="red", markup=False)

    def on_startup(self, event: dict[str, Any]) -> None:
        self.startup.append(event)

    def on_terminal(self, event: dict[str, Any]) -> None:
        self.outcome = event


# what following a run does with each type of event; other types are not shown
EVENT_HANDLERS: dict[str, Callable[[_Follower, dict[str, Any]], None]] = {
    "started": _Follower.on_started,
    "progress": _Follower.on_progress,
    "log": _Follower.on_message,
    "warning": _Follower.on_message,
    "rank_failed": _Follower.on_rank_failed,
    "startup": _Follower.on_startup,
    **dict.fromkeys(TERMINAL_TYPES, _Follower.on_terminal),
}
