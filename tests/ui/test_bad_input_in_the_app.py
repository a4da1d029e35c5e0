"""The app with damaged input: a corrupt replay trace and broken profiles are reported with their reason,
and the app keeps running."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.command import CommandPalette

from gpuopt_tui.app import make_app

from .conftest import notifications, screen_text, wait_for

HEADER = b'{"format": "gpuopt-tui-gpu-trace", "version": 1}\n'


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (HEADER + b'{"t": 1, "gpus": [5]}\n', "field 'gpus[0]': expected an object, got 5"),
        (HEADER + b'{"t": 1, "gpus": [{"index": 0, "memory_used": "lots"}]}\n', "field 'gpus[0].memory_used'"),
        (HEADER + b"\x00\xff\xfe\x1b[2J" * 50, "not a GPU trace (byte 50 is not UTF-8 text)"),
    ],
    ids=["gpus-not-objects", "wrong-type", "binary"],
)
async def test_a_corrupt_trace_is_reported_and_the_app_keeps_running(
    tmp_path: Path, content: bytes, reason: str
) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_bytes(content)
    app = make_app(replay=trace)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: any(reason in n for n in notifications(app)))
        await wait_for(pilot, lambda: "trace not shown" in screen_text(app))  # the GPU panel says why
        await pilot.press("g")
        await wait_for(pilot, lambda: app.current_mode == "gpu" and "trace not shown" in screen_text(app))
        await pilot.press("r")
        await wait_for(pilot, lambda: app.current_mode == "runs")
        assert app.is_running


async def test_broken_profiles_are_listed_in_the_palette_and_say_why(user_profiles: Path) -> None:
    (user_profiles / "typo-kind.toml").write_text('kind = "atribution"\n')
    (user_profiles / "[red]bad-toml.toml").write_text("kind = [\n")
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("ctrl+p")
        await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette))
        await pilot.press(*"typo-kind")
        await wait_for(pilot, lambda: "Run profile typo-kind (broken)" in screen_text(app))
        await pilot.press("enter")
        await wait_for(pilot, lambda: any("unknown run kind 'atribution'" in n for n in notifications(app)))
        await pilot.press("ctrl+p")
        await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette))
        await pilot.press(*"bad-toml")
        await wait_for(pilot, lambda: "Run profile [red]bad-toml (broken)" in screen_text(app))
        assert app.is_running


ODD_TRACE = HEADER + b"".join(
    line + b"\n"
    for line in (
        b'{"t": 9, "gpus": [{"index": 0, "name": "\\u001b[31mH100\\u0007", "power_draw": NaN, "power_limit": '
        b'Infinity, "memory_used": 1, "memory_total": 0, "util_sm": 9999}], "processes": [{"pid": 1, "gpu_index": 7, '
        b'"command": "\\u001b[2Jx", "user": "[bold]u"}], "notes": ["\\u001b]0;n\\u0007"]}',
        b'{"t": 3, "gpus": [{"index": 0, "lost": true}, {"index": 0}]}',
        b'{"t": 3, "gpus": []}',
    )
)


async def test_a_trace_with_odd_but_valid_values_is_shown(tmp_path: Path) -> None:
    """NaN power, escapes in names, a process on a GPU the sample lacks, a clock going back, a GPU index twice."""
    trace = tmp_path / "odd.jsonl"
    trace.write_bytes(ODD_TRACE)
    app = make_app(replay=trace, screen="gpu")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: "?[31mH100?" in screen_text(app))
        for key in ("down", "]", "[", "1", "enter", "d", "g"):
            await pilot.press(key)
        await wait_for(pilot, lambda: "LOST" in screen_text(app))  # the next sample, recorded "earlier"
        assert app.is_running and not notifications(app)
