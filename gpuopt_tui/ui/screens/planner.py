"""The memory planner screen: the memory of a plan profile's training setup in two tiers, each labelled, and the
recommendation written into the training config.

- Closed-form estimate: from the form, no GPU needed; it follows the form's edits. Bars of GPU memory with the
  margin, the recommended micro-batch and accumulation beside other candidates, one plan per curriculum stage,
  and the breakdown by component.
- Traced: on demand (Trace), the current setup's step run on fake tensors in a child process (any architecture, no
  GPU); its breakdown by component and by module beside the closed form, and the difference.
- Measured on GPU N: a background run of the profile with plan.measure = true (probes on the GPU; the run goes on
  if this terminal closes); its saved plan is shown once it finished.
- Preview changes: the diff that writes the candidate under the cursor into plan.config, in a dialog; confirming
  writes it with numbered backups (refused when the file changed since the preview or is read-only). Undo restores
  the newest backups after a diff of its own (refused likewise); core/planner/apply.py does both.

Files and NVML are read in thread workers (planner_tasks, imported by the first of them once no screen is being
switched to); their results come back as messages.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.content import Content
from textual.timer import Timer
from textual.widgets import Button, Checkbox, Static
from textual.worker import get_current_worker

from gpuopt_tui.core.errors import ProfileError, UserError
from gpuopt_tui.core.kinds import engine_available
from gpuopt_tui.core.profiles.plan import PlanProfile
from gpuopt_tui.core.runs.status import RunInfo
from gpuopt_tui.ui.loading import Loaded, reply
from gpuopt_tui.ui.run_poller import RunsSnapshot
from gpuopt_tui.ui.screens.kind import KindScreen
from gpuopt_tui.ui.widgets.diff_dialog import DiffDialog
from gpuopt_tui.ui.widgets.plan_run_view import PlanRunResults
from gpuopt_tui.ui.widgets.planner_view import PlanView, planner_tasks
from gpuopt_tui.ui.widgets.profile_form import ProfileForm
from gpuopt_tui.ui.widgets.profile_values import FORM_SOURCE
from gpuopt_tui.ui.widgets.tab_switch import TabSwitch

if TYPE_CHECKING:
    from gpuopt_tui.core.planner.apply import Restore
    from gpuopt_tui.core.planner.search import Candidate
    from gpuopt_tui.ui.planner_tasks import ClosedForm, PlanRun, Preview, Traced

ESTIMATE_DELAY_S = 0.8  # after the last edit of the form
NO_TRACE = (
    "No trace yet. Trace (ctrl+y) runs one training step of the model class on fake tensors in a child process: "
    "any architecture transformers builds from its config, no GPU, no weights, seconds. It shows the peak by "
    "component and by module, beside the closed form."
)
NO_MEASUREMENT = (
    "No measurement yet. Measure on GPU (ctrl+t) starts a background run of this profile with plan.measure = true: "
    "training steps probed on the GPU in fresh processes at 2-3 micro-batches, a line fit of peak reserved memory "
    "and one confirming probe. It goes on if this terminal closes."
)


class EstimateRead(Loaded):
    """The closed-form estimate of the form (a ClosedForm); `key`: the request's number."""


class MeasureChecked(Loaded):
    """Whether the profile can be measured: the profile to run and its GPU's label."""


class TraceRead(Loaded):
    """The current setup's step traced on fake tensors (planner_tasks.traced)."""


class ConfigTaskDone(Loaded):
    """A read or write of the training config or of the measured plan; a failure is reported under FAILED_TITLE."""

    FAILED_TITLE: ClassVar[str]


class MeasuredRunRead(ConfigTaskDone):
    """The newest run that measured this kind of plan (a PlanRun), or None."""

    FAILED_TITLE = "Measured plan not read"


class PreviewMade(ConfigTaskDone):
    """What writing a candidate into the config would change (a Preview)."""

    FAILED_TITLE = "No preview"


class RestorePreviewMade(ConfigTaskDone):
    """What restoring the newest backups would change (a list of Restore)."""

    FAILED_TITLE = "Nothing restored"


class ConfigApplied(ConfigTaskDone):
    """The config was written: what the notification says."""

    FAILED_TITLE = "Config not written"


class ConfigRestored(ConfigTaskDone):
    """The config was restored from its backups: what the notification says."""

    FAILED_TITLE = "Nothing restored"


class PlannerScreen(KindScreen):
    SCREEN_NAME = "planner"
    KIND = "plan"
    BROWSE_RESULTS = PlanRunResults

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+e", "estimate", "Estimate", id="planner.estimate", tooltip="Closed-form memory estimate"),
        Binding("ctrl+t", "measure", "Measure", id="planner.measure", tooltip="Measure on the GPU in a background run"),
        Binding(
            "ctrl+y",
            "trace",
            "Trace",
            id="planner.trace",
            tooltip="Trace the training step on fake tensors: any architecture, no GPU, seconds",
        ),
        Binding(
            "ctrl+o",
            "preview",
            "Preview",
            id="planner.preview",
            tooltip="Diff of writing the selected configuration into plan.config; apply it from there",
        ),
        Binding("ctrl+z", "undo", "Undo", id="planner.undo", tooltip="Restore the config from its newest backup"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self._seq = 0  # estimates asked for, numbered
        self._shown = 0  # the number of the estimate shown: one older than it is dropped when it comes
        self._estimated: object = None  # the form's values of the newest estimate
        self._in_flight: object = None  # the same while that estimate is being made
        self._timer: Timer | None = None
        self._plan_runs: object = None  # (id, status) of the plan runs last looked at
        self._tracing: Timer | None = None  # ticks the elapsed seconds while a trace runs
        self._trace_stage = ""  # what the trace says it is doing (set by its worker thread)

    # -- layout -------------------------------------------------------------------------------------------------

    def compose_side(self) -> ComposeResult:
        yield Static("Memory plan", id="plan-title", classes="pane-title")
        with Horizontal(id="plan-actions"):
            yield Button("Estimate", id="estimate", compact=True)
            yield Button("Measure on GPU", id="measure", compact=True)
            yield Button("Trace", id="trace", compact=True)
            yield Button("Preview changes", id="preview", variant="primary", compact=True)
            yield Button("Undo", id="undo", compact=True)
        yield Static("", id="plan-config", markup=False)
        yield Checkbox("also write the most samples per anchor into the stage files", id="plan-tune", compact=True)
        yield TabSwitch(
            ("Closed-form estimate", PlanView("estimating…", id="plan-closed")),
            ("Traced", PlanView(NO_TRACE, id="plan-traced")),
            ("Measured", PlanView(NO_MEASUREMENT, id="plan-measured")),
            id="plan-tabs",
        )

    def profile_opened(self) -> None:
        self._estimate_form()

    @property
    def base(self) -> Path:
        """Where relative paths in the profile start: its file's directory."""
        return self.path.parent.resolve() if self.path else Path.cwd()

    # -- reading and writing off the UI thread ---------------------------------------------------------------------

    def _tasks(self) -> ModuleType:
        """Thread work: ui/planner_tasks, once no screen is being switched to: its first import (60-80 ms of CPU) in
        the thread of the screen's first estimate would share the CPU with the drawing of the screen."""
        self.gapp.warmup.wait_until_quiet(get_current_worker())
        return planner_tasks()

    @work(thread=True, exclusive=True, group="plan-estimate", exit_on_error=False)
    def _estimate(self, seq: int, profile: PlanProfile, base: Path) -> None:
        reply(self, EstimateRead, seq, lambda: self._tasks().closed_form(profile, base))

    @work(thread=True, exclusive=True, group="plan-measure", exit_on_error=False)
    def _check_measure(self, profile: PlanProfile, base: Path) -> None:
        def check() -> tuple[PlanProfile, str]:
            tasks = planner_tasks()
            resolved = tasks.resolved(profile, base)
            gpu = tasks.measuring_gpu(resolved)
            resolved.plan.measure = True
            return resolved, gpu.label  # the profile to run and its GPU

        reply(self, MeasureChecked, None, check)

    @work(thread=True, exclusive=True, group="plan-measured", exit_on_error=False)
    def _find_measured(self, runs: list[RunInfo]) -> None:
        reply(self, MeasuredRunRead, None, lambda: self._tasks().newest_measuring_run(runs))

    @work(thread=True, exclusive=True, group="plan-write", exit_on_error=False)
    def _write(self, done: type[ConfigTaskDone], task: Callable[[], Any]) -> None:
        """`task` of writing the config, which replies with `done`."""
        reply(self, done, None, task)

    def _failed(self, message: ConfigTaskDone) -> bool:
        """Whether the task failed (the app then says why)."""
        if message.failed:
            self.gapp.report_error(message.reason, title=message.FAILED_TITLE)
        return message.failed

    # -- closed-form estimate -----------------------------------------------------------------------------------

    @on(Button.Pressed, "#estimate")
    def action_estimate(self) -> None:
        profile = self.current_profile("Not estimated")
        if isinstance(profile, PlanProfile):
            self._start_estimate(profile)

    @on(ProfileForm.Changed)
    def _form_edited(self) -> None:
        self._stop_timer()
        self._timer = self.set_timer(ESTIMATE_DELAY_S, self._follow_form)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.stop()
            self._timer = None

    def _follow_form(self) -> None:
        self._timer = None
        if self.form.values() != self._estimated:
            self._estimate_form()

    def _estimate_form(self) -> None:
        """The estimate of the form as it is, or why there is none (without notifications: it follows edits)."""
        view = self.query_one("#plan-closed", PlanView)
        form = self.form
        if form.disabled:
            view.show_message("Open a readable plan profile to see its memory.")
            return
        if not form.validate():
            key, message = next(iter(form.errors.items()))
            view.show_message(Content.from_markup("[$error]Fix the form to estimate: $key: $m[/]", key=key, m=message))
            return
        try:
            profile = form.profile(str(self.path or FORM_SOURCE))
        except UserError as e:
            view.show_message(Content.styled(str(e), "$error"))
            return
        assert isinstance(profile, PlanProfile)
        self._start_estimate(profile)

    def _start_estimate(self, profile: PlanProfile) -> None:
        self._stop_timer()
        values = self.form.values()
        self._estimated = values
        if values == self._in_flight:
            return  # the same estimate is on its way
        self._in_flight = values
        self._seq += 1
        view = self.query_one("#plan-closed", PlanView)
        if view.plan is None:
            view.show_message("estimating…")
        self._estimate(self._seq, profile, self.base)

    @on(EstimateRead)
    def _estimated_plan(self, message: EstimateRead) -> None:
        """An estimate, however it ended (an unexpected error also goes on to the app's report)."""
        if message.key == self._seq:
            self._in_flight = None
        if message.key < self._shown:
            return
        self._shown = message.key
        view = next(iter(self.query("#plan-closed").results(PlanView)), None)
        if view is None:  # the screen's widgets are gone: the app closed while the estimate ran
            return
        if message.failed:
            if isinstance(message.error, ProfileError):
                self.form.show_error(message.error.key, message.error.detail)
            view.show_message(Content.styled(message.reason, "$error"))
            self.query_one("#plan-config", Static).update("")
            return
        result: ClosedForm = message.value
        view.show_plan(result.plan)
        self.query_one("#plan-config", Static).update(result.config)
        self.query_one("#plan-tune", Checkbox).set_class(result.stages, "-shown")

    # -- traced tier ------------------------------------------------------------------------------------------------

    @on(Button.Pressed, "#trace")
    def action_trace(self) -> None:
        profile = self.current_profile("Not traced")
        if not isinstance(profile, PlanProfile) or self._tracing is not None:
            return
        self.query_one("#plan-tabs", TabSwitch).active = "plan-traced"
        view = self.query_one("#plan-traced", PlanView)
        started = time.monotonic()
        self._trace_stage = "starting a child process"

        def tick() -> None:
            view.show_message(
                f"Tracing one training step on fake tensors in a child process… {time.monotonic() - started:.0f} s: "
                f"{self._trace_stage}"
            )

        tick()
        self._tracing = self.set_interval(0.5, tick)
        self._trace(profile, self.base)

    @work(thread=True, exclusive=True, group="plan-trace", exit_on_error=False)
    def _trace(self, profile: PlanProfile, base: Path) -> None:
        def stage(line: str) -> None:
            self._trace_stage = line  # shown by the next tick

        reply(self, TraceRead, None, lambda: self._tasks().traced(profile, base, stage))

    @on(TraceRead)
    def _show_traced(self, message: TraceRead) -> None:
        if self._tracing is not None:
            self._tracing.stop()
            self._tracing = None
        view = self.query_one("#plan-traced", PlanView)
        if message.failed:
            view.show_message(Content.styled(message.reason, "$error"))
            return
        result: Traced = message.value
        view.show_report(result.head, *result.parts)

    # -- measured tier ------------------------------------------------------------------------------------------

    @on(Button.Pressed, "#measure")
    def action_measure(self) -> None:
        if not engine_available(self.KIND):
            self.app.notify("no engine for plan runs in this build", severity="error")
            return
        profile = self.current_profile("Not measured")
        if isinstance(profile, PlanProfile):
            self._check_measure(profile, self.base)

    @on(MeasureChecked)
    def _measure_checked(self, message: MeasureChecked) -> None:
        self.query_one("#plan-tabs", TabSwitch).active = "plan-measured"
        view = self.query_one("#plan-measured", PlanView)
        if message.failed:
            if view.plan is None:  # a plan measured before stays in view
                view.show_message(Content.styled(message.reason, "$error"))
            if isinstance(message.error, ProfileError):
                self.show_pane("form")
                self.form.show_error(message.error.key, message.error.detail)
            self.gapp.report_error(message.reason, title="Not measured")
            return
        profile, gpu = message.value
        run_dir = self.start(profile, title="Not measured")
        if run_dir is None:
            return
        view.show_message(f"Measuring on {gpu}: run {run_dir.name} started (see Latest run).")

    def runs_updated(self, snapshot: RunsSnapshot) -> None:
        super().runs_updated(snapshot)
        runs = [r for r in snapshot.runs if r.kind == self.KIND]
        key = tuple((r.id, r.status) for r in runs)
        if key != self._plan_runs:
            self._plan_runs = key
            self._find_measured(runs)

    @on(MeasuredRunRead)
    def _show_measured(self, message: MeasuredRunRead) -> None:
        if self._failed(message):
            return
        run: PlanRun | None = message.value
        view = self.query_one("#plan-measured", PlanView)
        if run is None:
            view.show_message(NO_MEASUREMENT)
        elif run.saved is not None:
            view.show_plan(planner_tasks().measured_plan(run, run.saved))
        elif run.info.active:
            view.show_message(f"Measuring on GPU {run.gpu}: run {run.info.id} is {run.info.status} (see Latest run).")
        else:
            why = run.error or run.info.message
            view.show_message(
                Content.styled(
                    f"The measuring run {run.info.id} on GPU {run.gpu} is {run.info.status}"
                    + (f": {why}" if why else "."),
                    "$error",
                )
            )

    # -- writing the config -------------------------------------------------------------------------------------

    @on(Button.Pressed, "#preview")
    def action_preview(self) -> None:
        view = self.query_one(f"#{self.query_one('#plan-tabs', TabSwitch).active}", PlanView)
        self._preview(view, view.selected)

    @on(PlanView.Picked)
    def _picked_candidate(self, event: PlanView.Picked) -> None:
        self._preview(event.view, event.candidate)

    def _preview(self, view: PlanView, choice: Candidate | None) -> None:
        """Preview writing `choice` (a row of `view`'s candidates) into the config, in a thread."""
        profile = self.current_profile("No preview")
        if not isinstance(profile, PlanProfile):
            return
        if view.plan is None:
            self.app.notify("no plan on this tab to write yet", title="No preview", severity="warning")
            return
        measured = view.plan.rec if view.id == "plan-measured" else None
        tune = self.query_one("#plan-tune", Checkbox).value
        self._write(PreviewMade, partial(planner_tasks().preview, profile, self.base, measured, choice, tune))

    @on(PreviewMade)
    def _ask_to_write(self, message: PreviewMade) -> None:
        if self._failed(message):
            return
        preview: Preview = message.value

        def answered(write: bool | None) -> None:
            if write:
                self._write(ConfigApplied, partial(planner_tasks().apply, preview))

        self.app.push_screen(DiffDialog(preview.question, preview.diff, "Apply", "Cancel"), answered)

    @on(Button.Pressed, "#undo")
    def action_undo(self) -> None:
        profile = self.current_profile("Nothing restored")
        if isinstance(profile, PlanProfile):
            self._write(RestorePreviewMade, partial(planner_tasks().undo_preview, profile, self.base))

    @on(RestorePreviewMade)
    def _ask_to_restore(self, message: RestorePreviewMade) -> None:
        if self._failed(message):
            return
        files: list[Restore] = message.value
        backups = ", ".join(f.backup.name for f in files)
        question = f"Restore {', '.join(f.path.name for f in files)} from {backups}? The backups are used up."
        if edited := [f.path.name for f in files if f.edits]:  # shown first: what the restore throws away
            question += f" {', '.join(edited)} changed after the planner wrote it: those edits (first diff) are lost."

        def answered(restore: bool | None) -> None:
            if restore:
                self._write(ConfigRestored, partial(planner_tasks().undo, files))

        diffs = "".join(f.edits for f in files) + "".join(f.diff for f in files)
        self.app.push_screen(DiffDialog(question, diffs, "Restore", "Keep"), answered)

    @on(ConfigApplied)
    @on(ConfigRestored)
    def _written(self, message: ConfigTaskDone) -> None:
        if self._failed(message):
            return
        self.app.notify(message.value, title="Config", timeout=10)
        self._estimate_form()  # the config changed, and so did the current setup
