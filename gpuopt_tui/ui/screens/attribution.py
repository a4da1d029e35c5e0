"""The Integrated Gradients attribution screen: the profile form, the latest run, and its results (samples
with token heatmaps, top tokens, convergence deltas, the optimized-vs-original check, exported files)."""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.binding import Binding, BindingType
from textual.widgets import Button

from gpuopt_tui.core.profiles.attribution import AttributionProfile
from gpuopt_tui.ui.screens.kind import KindScreen
from gpuopt_tui.ui.widgets.attribution_view import AttributionRunResults
from gpuopt_tui.ui.widgets.sample_browser import SampleBrowser

CHECK_SAMPLES = 8  # samples of a check run: each is attributed by both paths


class AttributionScreen(KindScreen):
    SCREEN_NAME = "attribution"
    KIND = "attribution"
    RESULTS = AttributionRunResults
    HELP_WIDGETS = (SampleBrowser,)

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
        if self.start(profile, title="Check not started") is not None:
            self.results.show_tab("tab-check")
