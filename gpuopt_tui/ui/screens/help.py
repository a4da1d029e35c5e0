"""Keys (read from the bindings themselves, so the list cannot drift) and a short guide."""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.content import Content
from textual.widgets import Static

from gpuopt_tui.ui.screens.base import AppScreen
from gpuopt_tui.ui.screens.kind import KindScreen
from gpuopt_tui.ui.screens.registry import SCREENS
from gpuopt_tui.ui.screens.results import ResultsScreen
from gpuopt_tui.ui.screens.runs import RunsScreen
from gpuopt_tui.ui.widgets.confirm import ConfirmDialog
from gpuopt_tui.ui.widgets.gpu_view import GpuView, ProcessList

GUIDE = "\n\n".join(
    [
        "gpuopt-tui configures, starts and watches interpretability runs. Every run is a separate process in its "
        "own session: quitting, a closed terminal or a dropped SSH connection does not stop it, and the next "
        "gpuopt-tui picks it up again with its live progress.",
        "1. Open the screen of a run kind (a, t, b, p) and pick a profile. Edit its fields: the line under the "
        "form explains the focused field, and a field the schema rejects says why in red. ctrl+s saves (your "
        "comments in the file are kept; a shipped profile is saved as your own copy of the same name); ctrl+n "
        "saves under a new name.",
        "2. ctrl+r starts a run with the values on screen. Its progress (rate, ETA, GPU memory) shows beside the "
        "form, then its results; ctrl+o shows them on the whole screen. On a terminal narrower than 100 columns "
        "the form and the run take turns: ctrl+l (or the tabs above them) switches.",
        "The focus: a profile screen opens with its form focused, so up and down move through the keys at once "
        "and enter edits one; tab and shift+tab move the focus to the profile picker, the buttons and the run's "
        "results. In a run's results opened from the runs list, left and right switch the view's tabs and the "
        "shown tab's keys work at once, wherever the focus is (an attribution run's Samples tab: / searches, s "
        "sorts, [ and ] turn pages); tab moves into the view (its table or list), and escape goes back.",
        "3. r lists every run: c cancels (the run stops after its current chunk and keeps what it finished), "
        "s resumes a stopped run from its finished shards, l follows the log, x deletes the run directory.",
        "4. The same from a shell: gpuopt-tui run PROFILE, gpuopt-tui runs, gpuopt-tui attach ID, "
        "gpuopt-tui cancel ID.",
        "Over SSH: start with --no-mouse if mouse reports garble the screen; ssh does not forward COLORTERM, so "
        "set TEXTUAL_COLOR_SYSTEM=truecolor when your terminal has true colour. Animations are off unless "
        "TEXTUAL_ANIMATIONS is set.",
    ]
)


class HelpScreen(AppScreen):
    SCREEN_NAME = "help"

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "app.back", "Back", id="help.back")]

    def compose_body(self) -> ComposeResult:
        with VerticalScroll(id="help-body"):
            yield Static(GUIDE, classes="help-guide", markup=False)
            yield Static(self._keys(), classes="help-keys")

    def _keys(self) -> Content:
        everywhere = [(s.key, f"{s.label}: {s.help}") for s in SCREENS]
        everywhere += [("ctrl+p", "Command palette: go to a screen, run a profile"), ("q", "Quit (runs keep going)")]
        groups = [
            ("Everywhere (when no text field has the focus)", self._rows(everywhere)),
            (
                "Profile screens",
                [*self._binding_rows(KindScreen.BINDINGS), *self._rows([("escape", "Leave the text field")])],
            ),
            *self._kind_screen_groups(),
            (
                "Runs screen",
                [
                    *self._binding_rows(RunsScreen.BINDINGS),
                    *self._rows([("enter", "Open the run's results (as on the dashboard)")]),
                ],
            ),
            (
                "A run's results (enter on a run; the keys of its kind's results, listed above, work there too)",
                self._binding_rows(ResultsScreen.BINDINGS, hidden=True),
            ),
            (
                "GPU screen (signals only with confirmation, never with --readonly or a replayed trace)",
                [
                    *self._binding_rows(GpuView.BINDINGS),
                    *self._rows([("0", "0-9: the GPU of that index")]),
                    *self._binding_rows(ProcessList.BINDINGS, hidden=True),
                ],
            ),
            ("Dialogs", self._binding_rows(ConfirmDialog.BINDINGS)),
        ]
        lines: list[Content] = []
        for title, keys in groups:
            lines.append(Content.from_markup("\n[b]$title[/]", title=title))
            for key, description in keys:
                lines.append(Content.from_markup("  [$accent]$key[/]  $what", key=key.ljust(8), what=description))
        return Content("\n").join(lines)

    def _kind_screen_groups(self) -> list[tuple[str, list[tuple[str, str]]]]:
        """The keys each run kind's screen adds: its own, and those of its results view."""
        groups = []
        for spec in SCREENS:
            screen = getattr(importlib.import_module(spec.module), spec.factory)
            if not (isinstance(screen, type) and issubclass(screen, KindScreen)):
                continue
            own = [b for b in screen.__dict__.get("BINDINGS", []) if isinstance(b, Binding)]
            rows = self._binding_rows(own)
            rows += self._binding_rows(screen.RESULTS.__dict__.get("BINDINGS", []))
            if rows:
                groups.append((f"{spec.label} screen", rows))
        return groups

    def _rows(self, keys: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return [(self.app.get_key_display(Binding(key, "")), description) for key, description in keys]

    def _binding_rows(self, bindings: list[BindingType], hidden: bool = False) -> list[tuple[str, str]]:
        """Key and description of the bindings shown in the footer (or of all, with `hidden`)."""
        return [
            (self.app.get_key_display(replace(b, key=b.key.split(",")[0])), b.tooltip or b.description)
            for b in bindings
            if isinstance(b, Binding) and (b.show or hidden)
        ]
