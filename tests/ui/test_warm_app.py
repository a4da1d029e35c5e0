"""`gpuopt-tui --warm`, or the command palette's "Keep a warm runner": the app keeps a warm runner (core/runs/warm.py)
while it is open, says so, and ends it when it quits."""

from __future__ import annotations

import os
import time

from textual.command import CommandPalette

from gpuopt_tui.app import make_app
from gpuopt_tui.core.runs.processes import pid_alive
from gpuopt_tui.core.runs.warm import ready_runners

from .conftest import notifications, palette_highlight, screen_text, wait_for

READY_S = 180.0  # the runner's imports on a busy 2-core machine


async def test_the_app_keeps_a_warm_runner_and_ends_it_on_quit() -> None:
    app = make_app(warm=True)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: any("warm runner" in n for n in notifications(app)))
        await wait_for(pilot, lambda: any(r.owner == os.getpid() for r in ready_runners()), timeout=READY_S)
        (runner,) = [r.pid for r in ready_runners() if r.owner == os.getpid()]
        await pilot.press("r")  # the Runs screen says it is ready
        await wait_for(pilot, lambda: f"warm runner ready (pid {runner})" in screen_text(app))
    deadline = time.monotonic() + 30
    while pid_alive(runner) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(runner)
    assert ready_runners() == []


async def test_the_command_palette_starts_one_in_an_app_without_it() -> None:
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        assert not app.warm
        await pilot.press("ctrl+p")
        await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette))
        await pilot.press(*"keep a warm")
        await wait_for(pilot, lambda: palette_highlight(app) == "Keep a warm runner")
        await pilot.press("enter")
        await wait_for(pilot, lambda: any(r.owner == os.getpid() for r in ready_runners()), timeout=READY_S)
        (runner,) = [r.pid for r in ready_runners() if r.owner == os.getpid()]
        assert app.warm
    deadline = time.monotonic() + 30
    while pid_alive(runner) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(runner)
