"""The app's screens: their names (also the values of `--screen`), keys and labels, created on first use.

Each screen is a Textual mode: it is built the first time it is shown and then kept, so switching back is instant
and a screen keeps its state (the profile being edited, the selected run).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from textual.screen import Screen

from gpuopt_tui.ui.textual_internals import mark_styled


@dataclass(frozen=True)
class ScreenSpec:
    name: str
    key: str  # the key that shows it
    label: str
    short: str  # label on narrow terminals
    module: str
    factory: str  # a Screen class, or a function taking the app and returning a screen
    help: str

    def create(self, app: Any) -> Screen:
        factory = getattr(importlib.import_module(self.module), self.factory)
        screen: Screen = factory() if isinstance(factory, type) else factory(app)
        # Textual re-reads and re-applies the whole stylesheet when it first shows a screen that has not seen the
        # app's latest CSS update (a theme change): a new screen's widgets are styled with the current CSS as they
        # mount, so after the first frame it has seen it (without this, every first visit parses all CSS again).
        # The first screen keeps the refresh: it is what applies the theme at start-up.
        if getattr(app, "startup_seconds", None) is not None:
            mark_styled(screen, app)
        return screen


_SCREENS_PACKAGE = "gpuopt_tui.ui.screens"

SCREENS: tuple[ScreenSpec, ...] = (
    ScreenSpec(
        name="dashboard",
        key="d",
        label="Dashboard",
        short="Dash",
        module=f"{_SCREENS_PACKAGE}.dashboard",
        factory="DashboardScreen",
        help="GPU panel and the list of runs",
    ),
    ScreenSpec(
        name="attribution",
        key="a",
        label="Attribution",
        short="Attr",
        module=f"{_SCREENS_PACKAGE}.attribution",
        factory="AttributionScreen",
        help="Integrated Gradients: edit a profile, run it, watch it",
    ),
    ScreenSpec(
        name="tracin",
        key="t",
        label="TracIn",
        short="TracIn",
        module=f"{_SCREENS_PACKAGE}.tracin",
        factory="TracInScreen",
        help="TracIn training-data influence: edit a profile, run it, watch it",
    ),
    ScreenSpec(
        name="ablation",
        key="b",
        label="Ablation",
        short="Abl",
        module=f"{_SCREENS_PACKAGE}.ablation",
        factory="AblationScreen",
        help="Layer ablation and probing: edit a profile, run it, watch it",
    ),
    ScreenSpec(
        name="planner",
        key="p",
        label="Planner",
        short="Plan",
        module=f"{_SCREENS_PACKAGE}.planner",
        factory="PlannerScreen",
        help="Memory planner: training memory estimate and batch size recommendation",
    ),
    ScreenSpec(
        name="runs",
        key="r",
        label="Runs",
        short="Runs",
        module=f"{_SCREENS_PACKAGE}.runs",
        factory="RunsScreen",
        help="Every run: cancel, resume, delete, read its log",
    ),
    ScreenSpec(
        name="gpu",
        key="g",
        label="GPU",
        short="GPU",
        module=f"{_SCREENS_PACKAGE}.gpu",
        factory="GpuScreen",
        help="Live GPU memory, utilisation and processes",
    ),
    ScreenSpec(
        name="help",
        key="question_mark",
        label="Help",
        short="Help",
        module=f"{_SCREENS_PACKAGE}.help",
        factory="HelpScreen",
        help="Keys and a short guide",
    ),
)
SCREEN_NAMES: tuple[str, ...] = tuple(s.name for s in SCREENS)


def screen_modules() -> tuple[str, ...]:
    """Every screen's module."""
    return tuple(s.module for s in SCREENS)


def spec(name: str) -> ScreenSpec:
    return next(s for s in SCREENS if s.name == name)
