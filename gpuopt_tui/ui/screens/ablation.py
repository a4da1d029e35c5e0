"""The Layer ablation and probing screen: the profile form, and the latest run's probes (ui/widgets/probing_results.py:
a table, a plot of accuracy against layer, and the feature cache)."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any, ClassVar

from textual.command import DiscoveryHit, Hit, Hits, Provider

from gpuopt_tui.ui.screens.kind import KindScreen
from gpuopt_tui.ui.widgets.probing_results import ProbingResults


class FeatureCacheCommands(Provider):
    """Command palette entries of the ablation screen: show or clear the feature cache."""

    def _commands(self) -> Iterator[tuple[str, Any, str]]:
        results = self.screen.query_one(ProbingResults)
        yield "Show the feature cache", partial(results.show_view, "cache"), "cached layer features, by representation"
        yield "Clear the feature cache", results.action_clear_cache, "delete every cached feature (asks first)"

    async def discover(self) -> Hits:
        for name, callback, help_text in self._commands():
            yield DiscoveryHit(name, callback, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, callback, help_text in self._commands():
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), callback, help=help_text)


class AblationScreen(KindScreen):
    SCREEN_NAME = "ablation"
    KIND = "ablation"
    RESULTS = ProbingResults
    COMMANDS: ClassVar[set[type[Provider]]] = {FeatureCacheCommands}
