"""The Layer ablation and probing screen: the profile form, and the latest run's probes (ui/widgets/probing_results.py:
a table, a plot of accuracy against layer, and the feature cache)."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import ClassVar

from textual.command import Provider

from gpuopt_tui.ui.palette import Command, CommandList
from gpuopt_tui.ui.screens.kind import KindScreen
from gpuopt_tui.ui.widgets.probing_results import ProbingResults


class FeatureCacheCommands(CommandList):
    """Command palette entries of the ablation screen: show or clear the feature cache."""

    def commands(self) -> Iterator[Command]:
        results = self.screen.query_one(ProbingResults)
        yield "Show the feature cache", partial(results.show_view, "cache"), "cached layer features, by representation"
        yield "Clear the feature cache", results.action_clear_cache, "delete every cached feature (asks first)"


class AblationScreen(KindScreen):
    SCREEN_NAME = "ablation"
    KIND = "ablation"
    RESULTS = ProbingResults
    COMMANDS: ClassVar[set[type[Provider]]] = {FeatureCacheCommands}
