"""The Integrated Gradients attribution screen: the profile form, the latest run, and its results (samples
with token heatmaps, top tokens, convergence deltas, the optimized-vs-original check, exported files).

A check run (ctrl+t) shows in the Check tab beside the run in view, which stays; in the Runs screen it is a run
like any other."""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.binding import Binding, BindingType
from textual.widgets import Button

from gpuopt_tui.core.profiles.attribution import AttributionProfile
from gpuopt_tui.core.runs.status import RunInfo
from gpuopt_tui.ui.run_poller import RunsSnapshot
from gpuopt_tui.ui.screens.kind import KindScreen
from gpuopt_tui.ui.widgets.attribution_view import AttributionRunResults

CHECK_SAMPLES = 8  # samples of a check run: each is attributed by both paths


class AttributionScreen(KindScreen):
    SCREEN_NAME = "attribution"
    KIND = "attribution"
    RESULTS = AttributionRunResults

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding(
            "ctrl+t",
            "check_paths",
            "Check",
            id="attribution.check",
            tooltip=f"Run this profile on {CHECK_SAMPLES} samples with the optimized and the original path and "
            "compare their scores",
        ),
    ]

    def __init__(self) -> None:
        super().__init__()
        self._checks: set[str] = set()  # ids of the check runs started here: shown in the Check tab only

    @property
    def results(self) -> AttributionRunResults:
        return self.query_one("#run-results", AttributionRunResults)

    @on(Button.Pressed, "#check-run")
    def action_check_paths(self) -> None:
        """Start the form's profile on a few samples with check_samples set (the rest of the profile as is)."""
        profile = self.current_profile("Check not started")
        if not isinstance(profile, AttributionProfile):
            return
        section = profile.attribution
        section.n_samples = min(section.n_samples, CHECK_SAMPLES) if section.n_samples else CHECK_SAMPLES
        section.check_samples = section.n_samples
        profile.name = f"{profile.name or self.KIND} check"
        run_dir = self.start(profile, title="Check not started")
        if run_dir is not None:
            self._checks.add(run_dir.name)
            self.results.show_tab("tab-check")

    def shown_run(self, snapshot: RunsSnapshot) -> RunInfo | None:
        """The newest attribution run other than the check runs started here: a check does not replace it."""
        return next((r for r in snapshot.runs if r.kind == self.KIND and r.id not in self._checks), None)

    def runs_updated(self, snapshot: RunsSnapshot) -> None:
        super().runs_updated(snapshot)
        self.results.show_check_run(next((r for r in snapshot.runs if r.id in self._checks), None))
