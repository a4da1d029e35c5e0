"""One tier of a memory plan on screen: its label, bars of GPU memory with the margin, the recommendation and the
candidate configurations side by side (a row can be picked to write), per-stage plans and the breakdown."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, ClassVar

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.content import Content
from textual.message import Message
from textual.widgets import DataTable, Static

if TYPE_CHECKING:
    from gpuopt_tui.core.planner.search import Candidate, Recommendation
    from gpuopt_tui.ui.plan_report import MemoryBar


def planner_tasks() -> ModuleType:
    """The planner's work: ui/planner_tasks, and core.planner under it (60-80 ms of imports on a small machine).
    Imported when first used, in the thread of the screen's first estimate (see PlannerScreen._tasks), so that the
    planner screen and its views are drawn without waiting for it; ui/plan_report likewise."""
    from gpuopt_tui.ui import planner_tasks as tasks

    return tasks


@dataclass(frozen=True)
class TierPlan:
    """What a tier found, ready to show."""

    head: Text  # the tier's label
    details: Sequence[RenderableType]  # what was planned: model, setup, budget, each value and its source
    rec: Recommendation
    current: MemoryBar | None  # the setup as configured (by component for the closed form)
    breakdown: Table | None  # the closed form's components
    notes: Sequence[str] = ()
    warnings: Sequence[str] = ()  # memory-relevant values only a default sets


def bars(plan: TierPlan) -> Group:
    """The current setup's bar above the recommended configuration's, each with its caption."""
    from gpuopt_tui.ui.plan_report import candidate_bar

    rec = plan.rec
    recommended = candidate_bar(rec.chosen, rec.budget.gpu_total, rec.budget.margin, "recommended")
    return Group(*(b for b in (plan.current, recommended) if b is not None))


def sections(first: RenderableType | None, *rest: RenderableType | None) -> Group:
    """`first`, then each of `rest` that is there after a blank line."""
    parts: list[RenderableType] = [first] if first is not None else []
    for part in rest:
        if part is not None:
            parts += [Text(""), part]
    return Group(*parts)


class PlanView(VerticalScroll):
    """Shows a TierPlan, or a message where there is none; `selected` is the candidate under the table's cursor."""

    DEFAULT_CSS: ClassVar[str] = """
    PlanView {
        height: 1fr;
        & > Static { height: auto; }
        & > DataTable { height: auto; max-height: 10; }
    }
    """

    class Picked(Message):
        """Enter on a candidate: write this one."""

        def __init__(self, view: PlanView, candidate: Candidate) -> None:
            super().__init__()
            self.view = view
            self.candidate = candidate

    def __init__(self, message: str = "", *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._message = message
        self.plan: TierPlan | None = None
        self._rows: list[Candidate] = []

    def compose(self) -> ComposeResult:
        # what is above the candidates; the candidates and what is below them are mounted with the first plan (a
        # tier never planned, or a screen's first showing, has no use for them)
        yield Static(self._message, classes="plan-head")

    def _plan_parts(self) -> tuple[DataTable[Text], Static]:
        """The candidates' table and what is below them, mounted the first time a plan is shown."""
        if not self.query(".plan-candidates"):
            self.mount(DataTable[Text](cursor_type="row", classes="plan-candidates"), Static("", classes="plan-tail"))
        return self.query_one(".plan-candidates", DataTable), self.query_one(".plan-tail", Static)

    def show_message(self, message: str | Content) -> None:
        """Only a message: the plan shown before (if any) is gone."""
        self.plan = None
        self._rows = []
        self.query_one(".plan-head", Static).update(message)
        for table in self.query(".plan-candidates").results(DataTable):
            table.clear()
            table.display = False
        for tail in self.query(".plan-tail"):
            tail.display = False

    def show_report(self, head: RenderableType, *parts: RenderableType | None) -> None:
        """A tier without candidates (the traced tier): its label and its tables, no plan to write."""
        self.show_message("")
        self.query_one(".plan-head", Static).update(sections(head, *parts))

    def show_plan(self, plan: TierPlan) -> None:
        from gpuopt_tui.core.planner.report import candidate_rows
        from gpuopt_tui.ui.plan_report import (
            CANDIDATE_COLUMNS,
            STAGES_TITLE,
            candidate_cells,
            recommendation_text,
            stages_table,
        )

        self.plan = plan
        rec = plan.rec
        colour = self.app.theme_variables.get("warning", "yellow")
        warnings = [Text(f"warning: {w}", colour) for w in plan.warnings]
        warnings += [Text(f"note: {n}", colour) for n in plan.notes]
        recommendation = Group(
            recommendation_text(rec),
            Text(f"effective batch target {rec.target} · enter on a row: preview writing it", style="dim"),
        )
        # warnings first: values only a default sets
        above = [Group(*warnings) if warnings else None, bars(plan), recommendation]
        self.query_one(".plan-head", Static).update(sections(plan.head, *above))
        table, tail = self._plan_parts()
        table.display = True
        table.clear(columns=True)  # columns keep the widths of what they held
        table.add_columns(
            *(Text(c, justify="left" if c in ("", "configuration") else "right") for c in CANDIDATE_COLUMNS)
        )
        rows = candidate_rows(rec)
        self._rows = [c for c, _ in rows]
        for c, chosen in rows:
            table.add_row(*candidate_cells(c, chosen))
        table.move_cursor(row=next(i for i, (_, chosen) in enumerate(rows) if chosen), scroll=False)
        stages = stages_table(rec.stages, title=STAGES_TITLE, file_names=True) if rec.stages else None
        tail.display = True
        tail.update(sections(None, stages, Group(*plan.details), plan.breakdown))

    @property
    def selected(self) -> Candidate | None:
        if not self._rows:
            return None
        row = self.query_one(".plan-candidates", DataTable).cursor_row
        return self._rows[row] if 0 <= row < len(self._rows) else None

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        picked = self.selected
        if picked is not None:
            self.post_message(self.Picked(self, picked))
