"""The one-line choosers of the profile screens (the profile picker, the editor of a key with choices): their menu
opens by keyboard or mouse, picks, closes without a change, and a pick reaches the form or opens the profile."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets import OptionList

from gpuopt_tui.app import make_app
from gpuopt_tui.core.paths import shipped_profiles_dir
from gpuopt_tui.core.profiles.io import find_profile
from gpuopt_tui.ui.screens.kind import KindScreen
from gpuopt_tui.ui.widgets.choice_field import BLANK, ChoiceField, ChoiceMenu
from gpuopt_tui.ui.widgets.confirm import ConfirmDialog

from .conftest import settle, wait_for


async def test_profile_picker_opens_the_profile_chosen_by_keyboard() -> None:
    app = make_app(screen="tracin")
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        screen = app.screen
        assert isinstance(screen, KindScreen)
        picker = screen.query_one("#profile-picker", ChoiceField)
        assert app.focused is screen.form.table  # the form first: its keys take the arrows at once
        picker.focus()
        await pilot.pause()
        assert picker.label == "demo-tracin" and screen.path == shipped_profiles_dir() / "demo-tracin.toml"
        await pilot.press("enter")
        assert isinstance(app.screen, ChoiceMenu)
        menu = app.screen.query_one(OptionList)
        labels = [str(label) for label, _ in picker.options]
        assert menu.highlighted == labels.index("demo-tracin")  # the menu starts at the value shown
        await pilot.press(*"tracin-all")  # typing jumps to the first label that starts so
        assert labels[menu.highlighted or 0] == "tracin-all-projected"
        await pilot.press("enter")
        target = find_profile("tracin-all-projected")
        await wait_for(pilot, lambda: screen.path == target)
        assert app.screen is screen and app.focused is picker
        assert picker.value == str(target)
        await pilot.press("space", "escape")  # opened and closed: nothing changes
        await pilot.pause()
        assert app.screen is screen and picker.value == str(target) and screen.path == target


async def test_profile_picker_by_mouse_asks_before_dropping_edits() -> None:
    app = make_app(screen="attribution")
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        screen = app.screen
        assert isinstance(screen, KindScreen)
        shipped = screen.path
        screen.form.edit_key("attribution.n_steps").value = "7"
        await pilot.pause()
        assert screen.form.dirty
        await pilot.click("#profile-picker")
        assert isinstance(app.screen, ChoiceMenu)
        await pilot.click(app.screen, offset=(110, 35))  # beside the menu: closes it
        assert app.screen is screen
        picker = screen.query_one("#profile-picker", ChoiceField)
        other = next(value for _, value in picker.options if value != str(shipped))
        await pilot.click("#profile-picker")
        await pilot.pause()  # the menu drawn: a click finds its option where it is drawn
        menu = app.screen.query_one(OptionList)
        row = [value for _, value in picker.options].index(other)
        await pilot.click(menu, offset=(2, row + 1))  # under its top border
        assert isinstance(app.screen, ConfirmDialog)
        await pilot.press("n")  # keep the edits: the picker shows the open profile again
        await pilot.pause()
        assert picker.value == str(shipped) and screen.path == shipped and screen.form.dirty
        picker.value = other
        await pilot.pause()
        await pilot.press("y")
        await wait_for(pilot, lambda: screen.path == Path(other))
        assert not screen.form.dirty


async def test_choice_editor_sets_the_key_from_its_menu() -> None:
    app = make_app(screen="planner")
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        screen = app.screen
        assert isinstance(screen, KindScreen)
        form = screen.form
        editor = form.edit_key("plan.gradient_checkpointing")
        await pilot.pause()
        assert isinstance(editor, ChoiceField) and app.focused is editor
        assert [label for label, _ in editor.options] == ["auto", "true", "false"] and editor.value == "auto"
        await pilot.press("enter", "down", "down", "enter")
        await pilot.pause()
        assert app.screen is screen and app.focused is editor
        assert editor.value is False and editor.label == "false"
        assert form.values()["plan"]["gradient_checkpointing"] is False and form.dirty
        optimizer = form.edit_key("plan.optimizer")  # another key with choices, then back: each shows its value
        assert optimizer is editor and editor.value == "adamw" and "sgd" in [v for _, v in editor.options]
        await pilot.pause()
        form.edit_key("plan.gradient_checkpointing")
        await pilot.pause()
        assert editor.value is False and form.values()["plan"]["optimizer"] == "adamw"


def test_a_value_must_be_one_of_the_options() -> None:
    field = ChoiceField([("one", 1), ("yes", True)], prompt="(none)")
    assert field.value is BLANK and field.label == "(none)"
    field.value = True
    assert field.label == "yes"
    with pytest.raises(ValueError, match="2 is not one of the options"):
        field.value = 2
    field.set_options([("one", 1)])  # True is not 1: the value is dropped
    assert field.value is BLANK
