"""The plan a plan run saved (results/plan.json), drawn as the planner's tiers are: bars of GPU memory, the
recommendation beside the other candidates, and each value with where it came from."""

from __future__ import annotations

from typing import Any

from textual import on, work
from textual.app import ComposeResult
from textual.content import Content
from textual.widgets import Static

from gpuopt_tui.core.runs.status import RunInfo
from gpuopt_tui.ui.loading import Loaded, reply
from gpuopt_tui.ui.widgets.planner_view import PlanView, planner_tasks
from gpuopt_tui.ui.widgets.run_results import RunResults


class PlanRunRead(Loaded):
    """A plan run as planner_tasks reads it (a PlanRun); `key`: its id."""


class PlanRunResults(RunResults):
    """A plan run's saved plan, read in a thread once the run finished; a failed run shows its log's end."""

    DEFAULT_CSS = """
    PlanRunResults { overflow-y: hidden; }
    PlanRunResults #results-text { height: auto; }
    PlanRunResults #saved-plan { height: 1fr; }
    """

    def compose(self) -> ComposeResult:
        yield from super().compose()
        yield PlanView("", id="saved-plan")

    _run_id: str | None = None  # the run shown

    @classmethod
    def read_finished(cls, info: RunInfo) -> Any:
        return planner_tasks().read_plan_run(info)

    @classmethod
    def import_reader(cls) -> None:
        planner_tasks()

    def run_changed(self, info: RunInfo | None) -> None:
        super().run_changed(info)
        self._run_id = info.id if info is not None else None
        failed = info is not None and info.status in ("failed", "crashed")
        self.query_one("#results-text", Static).display = failed
        view = self.query_one("#saved-plan", PlanView)
        view.display = not failed
        if info is None or info.status != "finished":
            view.show_message("" if info is None or not info.active else "The plan shows here when the run finishes.")
            return
        if (preread := self.take_preread(info, PlanRunRead, info.id)) is not None:
            self._plan_read(preread)
        else:
            view.show_message("Reading the plan…")
            self._read(info)

    @work(thread=True, exclusive=True, group="saved-plan", exit_on_error=False)
    def _read(self, info: RunInfo) -> None:
        reply(self, PlanRunRead, info.id, lambda: planner_tasks().read_plan_run(info))

    def describe(self, info: RunInfo | None) -> Content:
        """Only a failed run's words: the plan itself says the rest."""
        return super().describe(info) if info is not None and info.status in ("failed", "crashed") else Content("")

    @on(PlanRunRead)
    def _plan_read(self, message: PlanRunRead) -> None:
        if message.key != self._run_id:
            return  # read for a run no longer shown
        view = self.query_one("#saved-plan", PlanView)
        run = message.value
        if message.failed:
            view.show_message(Content.styled(message.reason, "$error"))
        elif run.saved is not None:
            view.show_plan(planner_tasks().measured_plan(run, run.saved))
        else:
            view.show_message(Content.styled(run.error or f"run {run.info.id} saved no plan", "$error"))

    def focus_first(self) -> None:
        self.query_one("#saved-plan", PlanView).focus()
