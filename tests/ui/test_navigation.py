"""Switching screens by keys, by clicks on the navigation bar and from the command palette."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.command import CommandPalette

from gpuopt_tui.app import make_app
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.ui.screens.registry import SCREENS
from gpuopt_tui.ui.widgets.confirm import ConfirmDialog

from .conftest import notifications, palette_highlight, screen_lines, wait_for


async def test_every_screen_has_a_key() -> None:
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        assert app.current_mode == "dashboard"
        for screen in SCREENS:
            await pilot.press(screen.key)
            await pilot.pause()
            assert app.current_mode == screen.name, screen.key
            assert screen.label in screen_lines(app)[0]  # the navigation bar names every screen


async def test_help_key_toggles_and_escape_goes_back() -> None:
    app = make_app(screen="runs")
    async with app.run_test() as pilot:
        await pilot.press("question_mark")
        assert app.current_mode == "help"
        await pilot.press("question_mark")
        assert app.current_mode == "runs"
        await pilot.press("question_mark", "escape")
        assert app.current_mode == "runs"


async def test_keys_do_not_switch_while_typing_in_a_field() -> None:
    app = make_app(screen="attribution")
    async with app.run_test(size=(120, 40)) as pilot:
        field = app.screen.form.edit_key("name")  # focused
        await pilot.press("end", "r", "d")
        assert app.current_mode == "attribution"
        assert field.value.endswith("rd")
        await pilot.press("escape", "r")  # escape leaves the field; keys work again
        assert app.current_mode == "runs"


@pytest.mark.parametrize("screen", ["attribution", "tracin", "ablation", "planner"])
async def test_arrows_move_through_a_profile_at_once(screen: str) -> None:
    """A profile screen opens with its form focused: down moves to the next key without tabbing there first."""
    app = make_app(screen=screen)
    async with app.run_test(size=(120, 40)) as pilot:
        form = app.screen.form
        await wait_for(pilot, lambda: form.table.row_count > 0 and form.current is not None)
        assert app.focused is form.table
        before = form.current
        await pilot.press("down")
        await wait_for(pilot, lambda: form.current != before)


async def test_help_says_where_the_focus_starts() -> None:
    app = make_app(screen="help")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        text = " ".join(app.screen.query_one("#help-body").query_one(".help-guide").render().plain.split())
        assert "opens with its form focused" in text and "left and right switch the view's tabs" in text
        keys = " ".join(str(app.screen.query_one(".help-keys").render()).split())
        assert "A run's results (enter on a run;" in keys and "The view's next tab" in keys


async def test_navigation_bar_is_clickable() -> None:
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        line = screen_lines(app)[0]
        await pilot.click(offset=(line.index("Runs"), 0))
        assert app.current_mode == "runs"


async def test_command_palette_switches_screens() -> None:
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("ctrl+p")
        await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette))
        await pilot.press(*"go to ablation")
        await wait_for(pilot, lambda: palette_highlight(app) == "Go to Ablation")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.current_mode == "ablation")


async def test_command_palette_offers_profiles_to_run() -> None:
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("ctrl+p")
        await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette))
        await pilot.press(*"run profile demo-attr")
        await wait_for(pilot, lambda: "Run profile demo-attribution" in "\n".join(screen_lines(app)))
        await pilot.press("escape")


async def test_screen_keys_wait_while_a_dialog_is_open() -> None:
    app = make_app()
    async with app.run_test() as pilot:
        answers: list[bool | None] = []
        app.push_screen(ConfirmDialog("Really?"), answers.append)
        await pilot.pause()
        await pilot.press("r")
        assert app.current_mode == "dashboard"
        await pilot.press("n")
        assert answers == [False]


async def test_q_quits() -> None:
    app = make_app()
    async with app.run_test() as pilot:
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running


def test_unknown_screen_and_missing_trace_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="unknown screen 'bogus'"):
        make_app(screen="bogus")
    with pytest.raises(UserError, match="no such trace file"):
        make_app(replay=tmp_path / "missing.jsonl")


async def test_worker_errors_become_notifications() -> None:
    app = make_app()
    async with app.run_test() as pilot:

        def broken() -> None:
            raise RuntimeError("disk on fire")

        def refused() -> None:
            raise UserError("the runs directory is read-only")

        app.run_worker(broken, name="listing", thread=True, exit_on_error=False)
        app.run_worker(refused, name="saving", thread=True, exit_on_error=False)
        expected = {"RuntimeError: disk on fire", "the runs directory is read-only"}
        await wait_for(pilot, lambda: expected <= set(notifications(app)))
        assert app.is_running


async def test_palette_run_of_a_profile_that_cannot_start_says_why(tmp_path: Path) -> None:
    profile = tmp_path / "needs-model.toml"
    profile.write_text('kind = "attribution"\n[model]\nadapter = "hf"\npath = "models/absent"\n', encoding="utf-8")
    app = make_app()
    async with app.run_test() as pilot:
        app.run_profile_file(profile)
        await pilot.pause()
        assert any(f"key 'model.path': {tmp_path / 'models' / 'absent'}" in n for n in notifications(app))
        assert app.current_mode == "dashboard"
