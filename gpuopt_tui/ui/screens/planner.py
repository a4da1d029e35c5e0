"""The memory planner screen: a plan profile, its closed-form memory estimate and recommendation on request,
and plan runs like the other kinds.

The estimate comes from `gpuopt_tui.core.planner.session` (no torch): the breakdown of the training step as
configured and the recommended micro-batch and accumulation under the budget.
"""

from __future__ import annotations

from typing import ClassVar

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.widgets import Static

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.format import human_bytes
from gpuopt_tui.core.planner import session
from gpuopt_tui.core.planner.estimate import Estimate
from gpuopt_tui.core.planner.search import Recommendation
from gpuopt_tui.core.profiles.plan import PlanProfile
from gpuopt_tui.ui.screens.kind import KindScreen

ESTIMATE_HINT = "ctrl+e: estimate the memory of this setup and recommend a batch (closed form, instant)"


def estimate_view(inputs: session.PlanInputs, est: Estimate, rec: Recommendation) -> Group:
    table = Table(box=None, header_style="bold", pad_edge=False, expand=False)
    table.add_column("component")
    table.add_column("size", justify="right")
    table.add_column("at peak", justify="center")
    for c in est.components:
        table.add_row(c.label, human_bytes(c.bytes), "yes" if c.in_peak else "")
    table.add_row(Text("peak reserved by torch", style="bold"), human_bytes(est.reserved), "")
    table.add_row(Text("total on the GPU", style="bold"), human_bytes(est.total), "")
    chosen = rec.chosen
    lines = [
        Text(f"{est.tier} of {inputs.model.label}, peak at {est.phase}", style="bold"),
        table,
        Text(
            f"budget {inputs.budget.margin:.0%} of {human_bytes(inputs.gpu.total)} ({inputs.gpu.label}) = "
            f"{human_bytes(inputs.budget.limit)}"
        ),
        Text(
            f"recommended ({rec.mode}): micro-batch {chosen.micro_batch} x accumulate {chosen.accumulate} = "
            f"{chosen.effective_batch}, {human_bytes(chosen.peak)} ({chosen.utilisation:.0%} of the GPU); "
            f"largest micro-batch under the budget: {rec.b_max}",
            style="bold",
        ),
        *(Text(f"note: {note}", style="yellow") for note in inputs.notes),
    ]
    return Group(*lines)


class PlannerScreen(KindScreen):
    SCREEN_NAME = "planner"
    KIND = "plan"

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+e", "estimate", "Estimate", id="planner.estimate", tooltip="Closed-form memory estimate"),
    ]

    class Estimated(Message):
        def __init__(self, view: Group | Text) -> None:
            super().__init__()
            self.view = view

    def compose_side(self) -> ComposeResult:
        yield Static("Memory estimate", classes="pane-title")
        yield Static(ESTIMATE_HINT, id="plan-estimate")

    def action_estimate(self) -> None:
        profile = self.current_profile("Not estimated")
        if not isinstance(profile, PlanProfile):
            return
        self.query_one("#plan-estimate", Static).update("estimating…")
        self.app.run_worker(
            lambda: self._estimate(profile),
            name="memory estimate",
            group="plan-estimate",
            thread=True,
            exclusive=True,
            exit_on_error=False,
        )

    def _estimate(self, profile: PlanProfile) -> None:
        """In a worker thread: reading configs and asking NVML for the GPU size may take a moment."""
        try:
            inputs = session.prepare(profile)
            view: Group | Text = estimate_view(
                inputs, session.estimate_current(inputs), session.recommend_closed_form(inputs)
            )
        except UserError as e:
            view = Text(str(e), style="red")
        self.post_message(self.Estimated(view))

    def on_planner_screen_estimated(self, message: Estimated) -> None:
        self.query_one("#plan-estimate", Static).update(message.view)
