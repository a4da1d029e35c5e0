"""The fence around Textual's private names: the installed Textual has every one; where one is missing, its
feature is turned off at start-up and the app works on the public path; no other module uses them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpuopt_tui.app import make_app
from gpuopt_tui.ui import textual_internals
from gpuopt_tui.ui.partial_updates import CroppingCompositor
from gpuopt_tui.ui.screens.registry import SCREENS
from gpuopt_tui.ui.textual_internals import CROPPED, NEEDS, STYLED, UNDERLINE, WARM_UP

from .conftest import screen_lines, settle, wait_for

PACKAGE = Path(__file__).parents[2] / "gpuopt_tui"
PRIVATE = re.compile(
    r"_screen_stacks|_get_screen\b|_load_screen_css|_refresh_layout|\._compositor|_highlight_active|_clear_caches"
    r"|_css_update_count|_message_queue|def _shutdown|def _on_click|textual\._"
)


@pytest.fixture(autouse=True)
def every_feature_on_again() -> None:
    yield
    textual_internals._off.clear()


async def test_the_installed_textual_has_every_private_name_the_app_uses() -> None:
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert textual_internals.missing_names(app, app.screen) == {}
        assert all(textual_internals.enabled(feature) for feature in NEEDS)


async def test_a_missing_name_turns_its_feature_off_and_the_app_takes_the_public_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gone = {feature: (*names, ("App", "_no_such_name")) for feature, names in NEEDS.items()}
    monkeypatch.setattr(textual_internals, "NEEDS", gone)
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.warmup.done)
        assert not any(textual_internals.enabled(f) for f in (WARM_UP, STYLED, CROPPED, UNDERLINE))
        assert textual_internals.missing_names(app, app.screen, gone)[WARM_UP] == ["App._no_such_name"]
        names = [s.name for s in SCREENS if s.name != "gpu"] + ["gpu"]
        for name in names:  # no screen was built unseen: each is built on its first showing, and works
            assert not textual_internals.mode_started(app, name) or name == "dashboard"
            await app.run_action(f"show('{name}')")
            await wait_for(pilot, lambda name=name: app.current_mode == name)
            await settle(pilot)
            assert screen_lines(app)[0].startswith("gpuopt-tui")
        assert not isinstance(app.screen._compositor, CroppingCompositor)  # the GPU screen, last shown


def test_no_module_but_the_fence_uses_textuals_private_names() -> None:
    users = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "textual_internals.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE.search(line.split("#")[0]) and not line.lstrip().startswith(('"', "`"))
    ]
    assert users == []
