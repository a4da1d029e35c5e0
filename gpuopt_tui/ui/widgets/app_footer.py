"""The footer of every screen, composed again only when the keys it shows changed."""

from __future__ import annotations

from textual.widgets import Footer


class AppFooter(Footer):
    """Textual's footer rebuilds its keys (new widgets, each styled) whenever the bindings may have changed, e.g.
    each time its screen is shown or the focus moves; here only when what it would show differs."""

    _shown: object = None

    async def recompose(self) -> None:
        if not self.is_attached:
            return
        shown = [(b.key, b.description, b.show, on, tip) for _, b, on, tip in self.screen.active_bindings.values()]
        if shown != self._shown:
            self._shown = shown
            await super().recompose()
