"""The screens built in the background after the first frame (ui/warmup.py): shown later, each looks exactly as
when it is the first screen; a key pressed meanwhile gets the screen being built; quitting meanwhile is clean."""

from __future__ import annotations

import gc

import pytest
from textual.pilot import Pilot

from gpuopt_tui.app import GpuOptApp, make_app
from gpuopt_tui.core.telemetry.backend import NoGpuSource
from gpuopt_tui.ui.gpu_telemetry import GpuTelemetry
from gpuopt_tui.ui.screens.registry import spec
from gpuopt_tui.ui.warmup import WARMED

from .conftest import screen_lines, settle, wait_for


def still_app(screen: str = "dashboard") -> GpuOptApp:
    """The app with a GPU source that never changes (no GPU), so that two pictures of a screen can be equal."""
    return make_app(screen=screen, telemetry=GpuTelemetry(NoGpuSource("no GPU in this test")))


async def warmed_up(pilot: Pilot[int]) -> None:
    await settle(pilot)
    await wait_for(pilot, lambda: pilot.app.warmup.done)  # type: ignore[attr-defined]
    await settle(pilot)


async def picture(app: GpuOptApp, key: str | None) -> str:
    """The app's screen as an SVG; the planner's as text, its plan pane left out: the width that pane's tables get
    depends on whether its scroll bar was there when the estimate came, whatever built the screen."""
    async with app.run_test(size=(120, 40)) as pilot:
        if key is None:
            await settle(pilot)
        else:
            await warmed_up(pilot)
            await pilot.press(key)
            await settle(pilot)
        if app.current_mode != "planner":
            return app.export_screenshot()
        pane = app.screen.query_one("#plan-tabs").region
        lines = screen_lines(app)
        outside = [
            line[: pane.x] + line[pane.right :] if pane.y <= y < pane.bottom else line for y, line in enumerate(lines)
        ]
        return "\n".join(outside)


# not the GPU screen: its plots move on with the time since the app started, and without a GPU its process list
# is hidden after the first poll, which takes the focus away from it when the screen was laid out before
@pytest.mark.parametrize("name", [name for name in WARMED if name != "gpu"])
async def test_a_screen_built_in_the_background_looks_as_when_shown_first(name: str) -> None:
    shown_first = await picture(still_app(name), None)
    assert await picture(still_app(), spec(name).key) == shown_first


async def test_every_screen_is_built_and_laid_out_without_being_shown() -> None:
    app = still_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await warmed_up(pilot)
        assert app.current_mode == "dashboard"
        for name in WARMED:
            screen = app._screen_stacks[name][0]
            assert screen.is_mounted and not screen.stack_updates  # built, never shown
            assert screen.size == app.size  # laid out at the terminal's size
        assert gc.isenabled()


async def test_a_key_pressed_while_its_screen_is_built_shows_that_screen() -> None:
    app = still_app()
    first = WARMED[0]
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: first in app.warmup._built)
        building = app.warmup._built[first]
        await pilot.press(spec(first).key)
        await settle(pilot)
        assert app.screen is building
        assert len(app.screen.query("#profile-picker")) == 1  # composed once: the profile bar is there


async def test_a_switch_holds_the_warm_up_back() -> None:
    app = still_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.warmup._reading is not None and app.warmup._reading.is_finished)
        built = dict(app.warmup._built)
        app.warmup.switching_to("help")
        app.warmup._step()  # what the step timer calls: it only arms itself again
        assert app.warmup._built == built


@pytest.mark.parametrize("steps", [1, 2, 4, 7])
async def test_quitting_while_screens_are_built_is_clean(steps: int) -> None:
    """`steps` steps into the warm-up (a screen being built, mounting or laid out), the app quits without an error
    (run_test re-raises any)."""
    app = still_app()
    ran = 0
    step = app.warmup._step

    def counted() -> None:
        nonlocal ran
        ran += 1
        step()

    app.warmup._step = counted  # type: ignore[method-assign]
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: ran >= steps)
