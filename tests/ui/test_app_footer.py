"""The footer: one widget showing the keys that work where the focus is, clickable, repainted only on change."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.command import CommandPalette
from textual.widget import Widget
from textual.widgets import Input

from gpuopt_tui.app import make_app
from gpuopt_tui.ui.screens.registry import SCREENS
from gpuopt_tui.ui.widgets.app_footer import AppFooter
from gpuopt_tui.ui.widgets.log_view import LogScreen

from .conftest import make_run, screen_lines, wait_for


class Pane(Widget, can_focus=True):
    """A focusable widget with keys of its own; `pressed` records the actions run on it."""

    DEFAULT_CSS = "Pane { height: 3; }"

    def __init__(self, *bindings: Binding, id: str) -> None:
        super().__init__(id=id)
        self._bindings = self._bindings.from_keys({b.key: [b] for b in bindings})
        self.pressed: list[str] = []

    def action_press(self, name: str) -> None:
        self.pressed.append(name)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return None if parameters == ("locked",) else True  # None: shown, dimmed, not run


class FooterApp(App[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Quit"),
        Binding("h", "bell", "Hidden", show=False),
    ]

    def compose(self) -> ComposeResult:
        yield Pane(Binding("e", "press('edit')", "Edit"), Binding("k", "press('locked')", "Locked"), id="left")
        yield Pane(Binding("e", "press('edit')", "Edit"), Binding("ctrl+x", "press('cut')", "Cut"), id="right")
        yield Pane(Binding("e", "press('edit')", "Edit"), Binding("k", "press('locked')", "Locked"), id="twin")
        yield Input(id="field")
        yield AppFooter()

    def on_mount(self) -> None:
        self.query_one("#left").focus()


def footer_line(app: App[object]) -> str:
    return screen_lines(app)[-1]


def footer_keys(app: App[object]) -> list[tuple[str, str]]:
    return [(k.display, k.description) for k in app.screen.query_one(AppFooter).keys]


async def test_the_footer_is_one_widget_showing_the_focused_widgets_keys_then_the_apps() -> None:
    app = FooterApp()
    async with app.run_test(size=(80, 10)) as pilot:
        await pilot.pause()
        footer = app.screen.query_one(AppFooter)
        assert not footer.children and len(app.screen.query(AppFooter)) == 1
        assert footer_keys(app) == [("e", "Edit"), ("k", "Locked"), ("q", "Quit"), ("^p", "palette")]
        line = footer_line(app)
        assert line.startswith(" e Edit  k Locked  q Quit ") and line.rstrip().endswith("▏^p palette"), line
        assert "Hidden" not in line


async def test_the_footer_follows_the_focus_and_repaints_only_when_its_keys_change() -> None:
    app = FooterApp()
    async with app.run_test(size=(80, 10)) as pilot:
        await pilot.pause()
        footer = app.screen.query_one(AppFooter)
        renders = 0
        render = footer.render

        def counted() -> object:
            nonlocal renders
            renders += 1
            return render()

        footer.render = counted  # type: ignore[method-assign]
        app.query_one("#twin").focus()  # other widget, same keys
        await pilot.pause()
        assert renders == 0
        app.query_one("#right").focus()
        await pilot.pause()
        assert footer_keys(app)[:2] == [("e", "Edit"), ("^x", "Cut")] and renders == 1
        assert "^x Cut" in footer_line(app) and "Locked" not in footer_line(app)
        app.query_one("#field").focus()  # an Input takes typed keys: e, k and q are no longer bindings
        await pilot.pause()
        assert [d for _, d in footer_keys(app)] == ["palette"]


async def test_clicking_a_key_runs_its_action_where_the_focus_is_and_a_disabled_one_only_rings() -> None:
    app = FooterApp()
    bells = 0

    def bell() -> None:
        nonlocal bells
        bells += 1

    app.bell = bell  # type: ignore[method-assign]
    async with app.run_test(size=(80, 10)) as pilot:
        await pilot.pause()
        line = footer_line(app)
        await pilot.click(AppFooter, offset=(line.index("Edit"), 0))
        await pilot.click(AppFooter, offset=(line.index("Locked"), 0))
        await pilot.pause()
        assert app.query_one("#left", Pane).pressed == ["edit"] and bells == 1


async def test_keys_that_do_not_fit_go_on_more_lines_none_hidden_and_all_clickable() -> None:
    app = make_app(screen="planner")
    async with app.run_test(size=(60, 20)) as pilot:
        await pilot.pause()
        footer = app.screen.query_one(AppFooter)
        await wait_for(pilot, lambda: footer.size.height > 1)
        lines = screen_lines(app)[-footer.size.height :]
        assert all(len(line) == 60 for line in lines)
        assert lines[0].startswith(" ^r Run  ^s Save") and lines[0].endswith("▏^p palette "), lines
        shown = " ".join(lines)
        assert all(f" {display} {description} " in shown for display, description in footer_keys(app)[:-1])
        row = next(y for y, line in enumerate(lines) if "Quit" in line)
        assert row > 0
        await pilot.hover(AppFooter, offset=(lines[row].index("Quit"), row))
        assert footer.tooltip == "Quit (runs keep going)"
        await pilot.click(AppFooter, offset=(lines[0].index("palette"), 0))  # not a key drawn under it
        await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette))


async def test_every_screens_keys_fit_at_80_columns_on_one_line_or_more() -> None:
    for spec in SCREENS:
        app = make_app(screen=spec.name)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            footer = app.screen.query_one(AppFooter)
            shown = " ".join(screen_lines(app)[-footer.size.height :])
            missing = [f"{d} {t}" for d, t in footer_keys(app)[:-1] if f" {d} {t} " not in shown]
            assert not missing, (spec.name, shown)


async def test_screens_show_their_keys_with_tooltips_and_a_click_opens_a_runs_log(runs_root: Path) -> None:
    make_run(runs_root, ("started", {"pid": 1, "attempt": 1}), ("finished", {"summary": {}}))
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: "l Log" in footer_line(app))
        line = footer_line(app)
        assert "o Sort" in line and "⏎ Results" in line and "q Quit" in line, line
        assert not any(f" {s.key} {s.label}" in line for s in SCREENS)  # the navigation keys are not shown
        await pilot.press("slash")  # the filter field takes the focus, and the keys it types
        await wait_for(pilot, lambda: "Sort" not in footer_line(app))
        await pilot.press("escape")
        await wait_for(pilot, lambda: "o Sort" in footer_line(app))
        await pilot.hover(AppFooter, offset=(footer_line(app).index("Sort"), 0))
        assert app.screen.query_one(AppFooter).tooltip == "Sort by the next column (or click a header)"
        await pilot.click(AppFooter, offset=(footer_line(app).index("Log"), 0))
        await wait_for(pilot, lambda: isinstance(app.screen, LogScreen))
        assert "esc Close" in footer_line(app)
