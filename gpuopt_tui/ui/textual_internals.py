"""Every use of Textual's private names, in one place, each behind a feature that can be turned off.

Textual has no public call for a few things the app does to be fast: build a screen before it is first shown
(the warm-up), keep a screen made after the first frame from being restyled when shown, send a live monitor's
terminal only the cells that changed, and place a tab bar's underline at once. `check` looks up, at start-up,
every private name each feature needs (on Textual's classes, and on the running app and its first screen for
the names Textual sets in `__init__`); a feature with a name missing is turned off, with a line in the log, and
the app takes the public path instead: slower, never wrong. Where a public equivalent exists the app uses it
(`App.get_screen_stack`, `DataTable.clear`, `on_click`), not the private name.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from textual.app import App, ReturnType
from textual.geometry import Size
from textual.message_pump import MessagePump
from textual.screen import Screen
from textual.widgets import Tabs

try:
    from textual._compositor import ChopsUpdate, Compositor
except ImportError:  # not in this Textual: CROPPED is off, and the classes based on these are never used
    ChopsUpdate = Compositor = object  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from collections.abc import Callable

logger = logging.getLogger(__name__)

WARM_UP = "screen warm-up"  # screens built, laid out and rendered before they are first shown (ui/warmup.py)
STYLED = "screens styled once"  # a screen made after the first frame is not restyled on its first showing
CROPPED = "cropped partial updates"  # the GPU screens send only the cells that changed (ui/partial_updates.py)
UNDERLINE = "tab underline at once"  # a tab bar mounted late places its underline without waiting for a resize

COMPOSITOR_MODULE = "textual._compositor"  # its ChopsUpdate and Compositor are subclassed in ui/partial_updates.py
# feature -> (owner, name): an owner is a Textual class, the running app or its screen ("app", "screen": the names
# Textual sets on each instance), or a module
NEEDS: dict[str, tuple[tuple[str, str], ...]] = {
    WARM_UP: (
        ("app", "_screen_stacks"),
        ("App", "_get_screen"),
        ("App", "_load_screen_css"),
        ("App", "_shutdown"),  # overridden below: the warm-up's screens settle before the app closes them
        ("Screen", "_refresh_layout"),
        ("screen", "_compositor"),
        ("MessagePump", "_message_queue"),
    ),
    STYLED: (("app", "_css_update_count"), ("screen", "_css_update_count")),
    CROPPED: (("screen", "_compositor"), (COMPOSITOR_MODULE, "Compositor"), (COMPOSITOR_MODULE, "ChopsUpdate")),
    UNDERLINE: (("Tabs", "_highlight_active"),),
}
_CLASSES: dict[str, type] = {"App": App, "Screen": Screen, "MessagePump": MessagePump, "Tabs": Tabs}
_off: set[str] = set()  # the features turned off by `check`


def missing_names(app: object, screen: object, needs: dict | None = None) -> dict[str, list[str]]:
    """Of each feature (of `needs`, else NEEDS), the private names this Textual lacks; features lacking none are
    left out."""
    owners: dict[str, object] = {"app": app, "screen": screen, **_CLASSES}
    missing = {}
    for feature, names in (NEEDS if needs is None else needs).items():
        gone = [f"{owner}.{name}" for owner, name in names if not _has(owners, owner, name)]
        if gone:
            missing[feature] = gone
    return missing


def _has(owners: dict[str, object], owner: str, name: str) -> bool:
    if owner in owners:
        return hasattr(owners[owner], name)
    try:
        return hasattr(importlib.import_module(owner), name)
    except ImportError:
        return False


def check(app: App[Any]) -> set[str]:
    """At start-up (the app mounted, its first screen made): turn off each feature this Textual cannot do."""
    missing = missing_names(app, app.screen)
    _off.clear()
    _off.update(missing)
    for feature, names in missing.items():
        logger.warning("Textual %s lacks %s: %s is off", _textual_version(), ", ".join(names), feature)
    return set(missing)


def enabled(feature: str) -> bool:
    return feature not in _off


def _textual_version() -> str:
    from importlib.metadata import version

    return version("textual")


# -- the warm-up: building a screen without showing it ---------------------------------------------------------


def mode_started(app: App[Any], mode: str) -> bool:
    """Whether mode `mode` has its screen (shown, or put there by `put_in_mode`)."""
    try:
        return bool(app.get_screen_stack(mode))
    except KeyError:
        return False


def put_in_mode(app: App[Any], mode: str, screen: Screen[Any]) -> None:
    """Make `screen` (built by `start_screen`) the screen of `mode`, as `App._init_mode` would."""
    app._screen_stacks[mode] = [screen]


def start_screen(app: App[Any], screen: Screen[Any]) -> None:
    """Register and start `screen` and load its CSS without showing it: it composes and mounts its widgets."""
    app._get_screen(screen)
    app._load_screen_css(screen)


def refresh_layout(screen: Screen[Any], size: Size) -> None:
    """Lay `screen` out at `size`, as showing it would."""
    screen._refresh_layout(size)


def render_lines(screen: Screen[Any]) -> None:
    """Render every line of the screen into its widgets' caches; nothing is written to the terminal."""
    screen._compositor.render_update(full=True)


def messages_waiting(pumps: Iterable[MessagePump]) -> bool:
    return not all(pump._message_queue.empty() for pump in pumps)


class BeforeShutdown(App[ReturnType]):
    """An app that runs `before_shutdown` before Textual closes its screens (on any way out: quit, ctrl+c, an
    error): there is no public hook that runs then."""

    async def before_shutdown(self) -> None:
        """Subclasses: what must finish before the screens are closed."""

    async def _shutdown(self) -> None:
        await self.before_shutdown()
        await super()._shutdown()


# -- the rest ----------------------------------------------------------------------------------------------------


def mark_styled(screen: Screen[Any], app: App[Any]) -> None:
    """Tell Textual that a screen made now has seen the app's latest CSS update, so its first showing does not
    re-read and re-apply the whole stylesheet (its widgets are styled with the current CSS as they mount)."""
    if enabled(STYLED):
        screen._css_update_count = app._css_update_count


def place_underline(tabs: Tabs) -> None:
    """Place the underline under the active tab now, as Tabs do on a resize (off: at the next resize)."""
    if enabled(UNDERLINE):
        tabs._highlight_active(animate=False)


def replace_compositor(screen: Screen[Any], make: Callable[[], object]) -> bool:
    """Give `screen` (not yet mounted) the compositor `make()` returns, where its own is Textual's Compositor."""
    if not enabled(CROPPED) or type(getattr(screen, "_compositor", None)) is not Compositor:
        return False
    screen._compositor = make()
    return True
