"""Command palette entries: a provider lists its commands, this shows and searches them.

Names and help are plain text, not markup: a profile named `[draft]` is shown as it is. (Textual's
`SimpleProvider` reads them as markup and takes its list when it is built; these lists are made each time the
palette opens, from the profiles on disk or the calling screen's widgets.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.content import Content
from textual.markup import escape

Command = tuple[str, Callable[[], object], str]  # name, what it does, help


class CommandList(Provider):
    """A palette provider over the (name, callback, help) entries of `commands()`, listed when the palette
    opens."""

    def commands(self) -> Iterable[Command]:
        raise NotImplementedError

    async def startup(self) -> None:
        self._listed = list(self.commands())

    async def discover(self) -> Hits:
        for name, callback, help_text in self._listed:
            yield DiscoveryHit(escape(name), callback, text=name, help=escape(help_text))

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, callback, help_text in self._listed:
            score = matcher.match(name)
            if score > 0:
                # highlight() reads its text as markup: a name with brackets is shown plain instead
                shown = matcher.highlight(name) if "[" not in name else Content(name)
                yield Hit(score, shown, callback, text=name, help=escape(help_text))
