"""One tier of a memory plan on screen: its label, bars of GPU memory with the margin, the recommendation and the
candidate configurations side by side (a row can be picked to write), per-stage plans and the breakdown."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.content import Content
from textual.message import Message
from textual.widgets import DataTable, Static

from gpuopt_tui.core.plan_report import (
    CANDIDATE_COLUMNS,
    STAGES_TITLE,
    MemoryBar,
    candidate_bar,
    candidate_cells,
    candidate_rows,
    recommendation_text,
    stages_table,
)
from gpuopt_tui.core.planner.search import Candidate, Recommendation


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
    rec = plan.rec
    recommended = candidate_bar(rec.chosen, rec.budget.gpu_total, rec.budget.margin, "recommended")
    return Group(*(b for b in (plan.current, recommended) if b is not None))


class PlanView(VerticalScroll):
    """Shows a TierPlan, or a message where there is none; `selected` is the candidate under the table's cursor."""

    DEFAULT_CSS: ClassVar[str] = """
    PlanView {
        height: 1fr;
    }
    PlanView > Static {
        height: auto;
    }
    PlanView .plan-section {
        margin-top: 1;
    }
    PlanView DataTable {
        height: auto;
        max-height: 10;
    }
    PlanView .plan-notes {
        color: $warning;
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
        yield Static(self._message, classes="plan-head")
        yield Static("", classes="plan-notes plan-section")  # warnings first: values only a default sets
        yield Static("", classes="plan-bars plan-section")
        yield Static("", classes="plan-recommendation plan-section")
        yield DataTable(cursor_type="row", classes="plan-candidates")
        yield Static("", classes="plan-stages plan-section")
        yield Static("", classes="plan-details plan-section")
        yield Static("", classes="plan-breakdown plan-section")

    def on_mount(self) -> None:
        self._show_parts(False)

    def _show_parts(self, shown: bool) -> None:
        for widget in self.query(".plan-section, DataTable"):
            widget.display = shown

    def show_message(self, message: str | Content) -> None:
        """Only a message: the plan shown before (if any) is gone."""
        self.plan = None
        self._rows = []
        self.query_one(".plan-head", Static).update(message)
        self.query_one(DataTable).clear()
        self._show_parts(False)

    def show_plan(self, plan: TierPlan) -> None:
        self.plan = plan
        rec = plan.rec
        self.query_one(".plan-head", Static).update(plan.head)
        self.query_one(".plan-bars", Static).update(bars(plan))
        self.query_one(".plan-recommendation", Static).update(
            Group(
                recommendation_text(rec),
                Text(f"effective batch target {rec.target} · enter on a row: preview writing it", style="dim"),
            )
        )
        self._show_parts(True)
        table = self.query_one(DataTable)
        table.clear(columns=True)  # columns keep the widths of what they held
        table.add_columns(
            *(Text(c, justify="left" if c in ("", "configuration") else "right") for c in CANDIDATE_COLUMNS)
        )
        rows = candidate_rows(rec)
        self._rows = [c for c, _ in rows]
        for c, chosen in rows:
            table.add_row(*candidate_cells(c, chosen))
        table.move_cursor(row=next(i for i, (_, chosen) in enumerate(rows) if chosen), scroll=False)
        stages = self.query_one(".plan-stages", Static)
        stages.display = bool(rec.stages)
        stages.update(stages_table(rec.stages, title=STAGES_TITLE, file_names=True) if rec.stages else "")
        self.query_one(".plan-details", Static).update(Group(*plan.details))
        breakdown = self.query_one(".plan-breakdown", Static)
        breakdown.display = plan.breakdown is not None
        breakdown.update(plan.breakdown or "")
        notes = self.query_one(".plan-notes", Static)
        lines = [Content(f"warning: {w}") for w in plan.warnings] + [Content(f"note: {n}") for n in plan.notes]
        notes.display = bool(lines)
        notes.update(Content("\n").join(lines))

    @property
    def selected(self) -> Candidate | None:
        if not self._rows:
            return None
        row = self.query_one(DataTable).cursor_row
        return self._rows[row] if 0 <= row < len(self._rows) else None

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        picked = self.selected
        if picked is not None:
            self.post_message(self.Picked(self, picked))
