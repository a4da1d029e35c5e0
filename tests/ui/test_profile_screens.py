"""The profile screens: a form generated from the schema, validated inline, saved with comments kept; bad
profiles and bad values give clear messages while the app keeps running."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from textual.widgets import Input

from gpuopt_tui.app import make_app
from gpuopt_tui.core.paths import shipped_profiles_dir
from gpuopt_tui.core.profiles.attribution import AttributionProfile
from gpuopt_tui.core.profiles.io import load_profile
from gpuopt_tui.core.profiles.plan import PlanProfile
from gpuopt_tui.core.profiles.schema import describe
from gpuopt_tui.ui import planner_tasks
from gpuopt_tui.ui.screens import kind as kind_screen
from gpuopt_tui.ui.screens.kind import KindScreen
from gpuopt_tui.ui.widgets.choice_field import ChoiceField
from gpuopt_tui.ui.widgets.confirm import ConfirmDialog
from gpuopt_tui.ui.widgets.profile_values import field_error, field_text, parse_field
from gpuopt_tui.ui.widgets.prompt import TextPrompt

from .conftest import flat_text, notifications, screen_text, settle, wait_for, widget_text

FIELDS = {info.key: info for info in describe(AttributionProfile)}


def test_fields_read_like_set_overrides() -> None:
    assert parse_field(FIELDS["attribution.n_steps"], " 200 ") == 200
    assert parse_field(FIELDS["attribution.alpha_batch_size"], "auto") == "auto"
    assert parse_field(FIELDS["attribution.memory_fraction"], "0.5") == 0.5
    assert parse_field(FIELDS["attribution.n_steps"], "many") == "many"  # left for the schema to reject
    assert parse_field(FIELDS["name"], "  spaced ") == "  spaced "
    info = FIELDS["attribution.delta_warning"]
    assert parse_field(info, field_text(info, 1e-7)) == 1e-7


def test_field_errors_come_from_the_schema() -> None:
    assert field_error(AttributionProfile, "attribution.n_steps", "many") == 'expected an integer or "auto", got "many"'
    assert field_error(AttributionProfile, "attribution.n_steps", 0) == 'expected an integer >= 1 or "auto", got 0'
    assert "expected one of" in field_error(AttributionProfile, "attribution.method", "simpson")
    assert field_error(AttributionProfile, "attribution.n_steps", 64) == ""
    # a rule between fields is not blamed on the field being checked alone
    assert field_error(AttributionProfile, "model.adapter", "hf") == ""


async def test_form_shows_the_shipped_demo_profile() -> None:
    app = make_app(screen="attribution")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, KindScreen)
        assert screen.path == shipped_profiles_dir() / "demo-attribution.toml"
        expected = load_profile(screen.path)
        assert screen.form.values()["attribution"]["n_steps"] == expected.attribution.n_steps
        assert screen.form.edit_key("model.adapter").value == "demo"
        assert screen.form.edit_key("attribution.use_amp").value is expected.attribution.use_amp
        assert "shipped: demo-attribution.toml" in screen_text(app)
        # "from": the profile for what the file sets, also where that equals the default; default for the rest
        assert FIELDS["run.device"].default == expected.run.device
        assert "attribution.delta_warning" not in screen.path.read_text()
        came_from = {
            key: screen.form.table.get_row(key)[2].plain for key in ("run.device", "attribution.delta_warning")
        }
        assert came_from == {"run.device": "profile", "attribution.delta_warning": "default"}


async def test_bad_values_are_marked_inline_and_block_save_and_run(runs_root: Path) -> None:
    app = make_app(screen="attribution")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, KindScreen)
        steps = screen.form.edit_key("attribution.n_steps")  # the cursor on the key, the focus in its editor
        steps.value = ""
        await pilot.press(*"12x")
        await pilot.pause()
        assert screen.form.errors == {"attribution.n_steps": 'expected an integer or "auto", got "12x"'}
        assert 'expected an integer or "auto", got "12x"' in screen_text(app)
        await pilot.press("ctrl+s")
        await pilot.press("ctrl+r")
        await pilot.pause()
        assert any("attribution.n_steps" in n for n in notifications(app))
        assert not runs_root.exists() or not any(runs_root.iterdir())
        assert not (Path(os.environ["GPUOPT_TUI_HOME"]) / "config" / "profiles").exists()
        await pilot.press("backspace")
        await pilot.pause()
        assert screen.form.errors == {}


async def test_quitting_with_unsaved_edits_asks_first() -> None:
    app = make_app(screen="attribution")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, KindScreen)
        steps = screen.form.edit_key("attribution.n_steps")
        steps.value = "64"
        await pilot.pause()
        assert screen.form.dirty
        await app.run_action("quit")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        await settle(pilot)
        text = " ".join(widget_text(app, ".dialog-text").split())
        assert "lose the edits to attribution profile demo-attribution" in text and "ctrl+s" in text
        await app.run_action("quit")  # quit again while asked: the edits still need an answer
        await pilot.pause()
        assert app.is_running and isinstance(app.screen, ConfirmDialog)
        await pilot.press("n")  # stay: the edits are kept
        await wait_for(pilot, lambda: app.screen is screen)
        assert screen.form.values()["attribution"]["n_steps"] == 64
        await app.run_action("quit")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog))
        await settle(pilot)
        await pilot.press("y")
        await wait_for(pilot, lambda: not app.is_running)


async def test_rule_between_fields_is_shown_at_the_field_it_names() -> None:
    app = make_app(screen="attribution")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, KindScreen)
        screen.form.edit_key("attribution.baseline").value = "custom"
        await pilot.pause()
        assert screen.form.errors == {"attribution.custom_baseline_token": "baseline = custom needs the token to use"}


async def test_missing_model_directory_is_reported_and_no_run_starts(runs_root: Path, tmp_path: Path) -> None:
    app = make_app(screen="attribution")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, KindScreen)
        screen.form.edit_key("model.adapter").value = "hf"
        screen.form.edit_key("model.path").value = str(tmp_path / "no-such-model")
        await pilot.pause()
        assert screen.form.errors == {}  # the schema is satisfied; the directory is checked when a run starts
        await pilot.press("ctrl+r")
        await pilot.pause()
        assert any(f"{tmp_path / 'no-such-model'}: no such file or directory" in n for n in notifications(app))
        assert "no such file" in screen.form.errors.get("model.path", "")
        assert not runs_root.exists() or not any(runs_root.iterdir())
        assert app.is_running


async def test_saving_a_shipped_profile_writes_a_user_copy_that_keeps_its_comments(user_profiles: Path) -> None:
    shipped = shipped_profiles_dir() / "demo-attribution.toml"
    original = shipped.read_text(encoding="utf-8")
    app = make_app(screen="attribution")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, KindScreen)
        screen.form.edit_key("attribution.n_steps").value = "77"
        await pilot.pause()
        assert "(modified)" in screen_text(app)
        await pilot.press("ctrl+s")
        await pilot.pause()
        saved = user_profiles / "demo-attribution.toml"
        assert screen.path == saved
        assert "(modified)" not in screen_text(app)
    assert shipped.read_text(encoding="utf-8") == original
    text = saved.read_text(encoding="utf-8")
    comments = [line for line in original.splitlines() if line.startswith("#")]
    assert comments and all(line in text.splitlines() for line in comments)
    assert load_profile(saved).attribution.n_steps == 77


async def test_save_as_names_a_new_profile(user_profiles: Path) -> None:
    app = make_app(screen="attribution")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: isinstance(app.screen, TextPrompt))
        field = app.screen.query_one(Input)
        field.value = "bad name/"
        await pilot.press("enter")
        assert isinstance(app.screen, TextPrompt)  # refused, with the reason shown
        assert "no spaces or slashes" in screen_text(app)
        field.value = "my-ig"
        await pilot.press("enter")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, KindScreen)
        assert screen.path == user_profiles / "my-ig.toml"
        assert load_profile(screen.path).kind == "attribution"
        assert "my-ig (yours)" in [str(label) for label, _ in screen.query_one("#profile-picker", ChoiceField).options]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('kind = "attribution"\n[attribution\nn_steps = 3\n', "not valid TOML"),
        ('kind = "atribution"\n', "unknown run kind 'atribution' (did you mean 'attribution'?)"),
    ],
)
async def test_unusable_profiles_are_listed_with_their_error(user_profiles: Path, text: str, message: str) -> None:
    (user_profiles / "broken.toml").write_text(text, encoding="utf-8")
    app = make_app(screen="attribution")
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)  # profiles are read in a thread
        screen = app.screen
        assert isinstance(screen, KindScreen)
        picker = screen.query_one("#profile-picker", ChoiceField)
        picker.value = str(user_profiles / "broken.toml")
        await settle(pilot)
        assert any(message in n for n in notifications(app))
        assert message in flat_text(app)
        assert screen.form.disabled
        await pilot.press("ctrl+r")  # nothing to run; says so
        await pilot.pause()
        assert any("open a readable profile first" in n for n in notifications(app))
        picker.value = str(shipped_profiles_dir() / "demo-attribution.toml")
        await settle(pilot)
        assert not screen.form.disabled
        assert app.is_running


async def test_kind_without_engine_says_so(monkeypatch: pytest.MonkeyPatch, runs_root: Path) -> None:
    monkeypatch.setattr(kind_screen, "engine_available", lambda kind: False)
    app = make_app(screen="tracin")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert "No engine for TracIn training-data influence in this build yet" in widget_text(app, "#engine-note")
        await pilot.press("ctrl+r")
        await pilot.pause()
        assert any("no engine for tracin" in n for n in notifications(app))
        assert not runs_root.exists()


async def test_unwritable_runs_directory_is_reported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    runs = locked / "runs"
    if os.access(locked, os.W_OK):  # root ignores the mode: a path under a regular file cannot be created either
        (tmp_path / "file").write_text("")
        runs = tmp_path / "file" / "runs"
    monkeypatch.setenv("GPUOPT_TUI_RUNS_DIR", str(runs))
    app = make_app(screen="attribution")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        await pilot.press("ctrl+r")
        await pilot.pause()
        assert any("cannot create the run directory" in n for n in notifications(app))
        assert app.is_running
    locked.chmod(0o755)


async def test_planner_estimates_memory_without_a_run() -> None:
    app = make_app(screen="planner")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        await pilot.press("ctrl+e")
        await wait_for(pilot, lambda: "total on the GPU" in screen_text(app))
        assert "closed-form estimate of demo" in screen_text(app)
        assert "recommended (exact)" in screen_text(app)


async def test_cancel_the_latest_run_from_its_screen(live_run: tuple[Path, subprocess.Popen[bytes]]) -> None:
    run_dir, proc = live_run
    app = make_app(screen="attribution")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: (info := app.runs.latest("attribution")) is not None and info.active)
        await pilot.pause()
        assert run_dir.name in widget_text(app, "#run-progress")
        assert "waiting for the first progress report" in widget_text(app, "#run-progress")
        await pilot.press("ctrl+g")
        assert isinstance(app.screen, ConfirmDialog)
        await pilot.press("y")
        proc.wait(timeout=10)
        assert proc.returncode == -signal.SIGTERM
        await wait_for(pilot, lambda: not app.screen.query_one("#cancel").display)


async def test_bool_or_auto_fields_keep_auto_through_save_and_estimate(
    user_profiles: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    requested: list[object] = []
    closed_form = planner_tasks.closed_form

    def recording(profile: PlanProfile, base: Path) -> planner_tasks.ClosedForm:
        requested.append(profile.plan.gradient_checkpointing)
        return closed_form(profile, base)

    monkeypatch.setattr(planner_tasks, "closed_form", recording)
    app = make_app(screen="planner")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, KindScreen)
        editor = screen.form.edit_key("plan.gradient_checkpointing", focus=False)
        assert isinstance(editor, ChoiceField) and editor.value == "auto"
        await pilot.press("ctrl+e")
        await wait_for(pilot, lambda: "total on the GPU" in screen_text(app))
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert screen.path == user_profiles / "demo-plan.toml"
        before_edit = list(requested)  # the edit below may start a live estimate of its own, with False
        editor.value = False
        await pilot.pause()
        assert screen.form.values()["plan"]["gradient_checkpointing"] is False
    assert before_edit and set(before_edit) == {"auto"}
    assert load_profile(user_profiles / "demo-plan.toml").plan.gradient_checkpointing == "auto"
