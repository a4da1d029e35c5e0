"""The runs screen and the run poller, on real run directories: failed runs explain themselves, damaged or
vanished runs give clear messages, and cancel / resume / delete ask first and keep the app running."""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path

from rich.text import Text
from textual.widgets import Log

from gpuopt_tui.app import make_app
from gpuopt_tui.ui.run_poller import RunsPolled
from gpuopt_tui.ui.screens.runs import RunsScreen
from gpuopt_tui.ui.widgets.confirm import ConfirmDialog
from gpuopt_tui.ui.widgets.log_view import LogScreen
from gpuopt_tui.ui.widgets.runs_table import RunsTable

from .conftest import flat_text, make_run, notifications, wait_for, widget_text

FAILED_LOG = "[info] loading\nTraceback (most recent call last):\nValueError: shapes do not match\n"


def table_cell(app: object, run_id: str, column: str) -> str:
    table = app.screen.query_one("#runs-table", RunsTable)  # type: ignore[attr-defined]
    value = table.get_cell(run_id, column)
    return value.plain if isinstance(value, Text) else str(value)


def log_lines(app: object, selector: str) -> list[str]:
    return list(app.screen.query_one(selector, Log).lines)  # type: ignore[attr-defined]


async def test_failed_run_shows_its_message_and_log(runs_root: Path) -> None:
    run_dir = make_run(
        runs_root,
        ("started", {"pid": 1, "attempt": 1}),
        ("failed", {"message": "ValueError: shapes do not match (traceback in log.txt)"}),
        log=FAILED_LOG,
    )
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.runs.get(run_dir.name) is not None)
        await pilot.pause()
        assert table_cell(app, run_dir.name, "status") == "failed"
        assert "shapes do not match" in widget_text(app, "#detail-progress")
        assert "ValueError: shapes do not match" in log_lines(app, "#detail-log")
        await pilot.press("a")  # the kind screen shows the same failure with the log tail
        await pilot.pause()
        assert "shapes do not match" in widget_text(app, "#run-progress")
        assert "End of log.txt" in widget_text(app, "#results-text")
        assert "ValueError: shapes do not match" in log_lines(app, "#results-log")


async def test_corrupt_events_are_skipped_and_counted(runs_root: Path) -> None:
    run_dir = make_run(runs_root, ("started", {"pid": 1, "attempt": 1}))
    with (run_dir / "events.jsonl").open("a", encoding="utf-8") as f:
        f.write("{not json}\n")
        f.write('{"t": 1, "type": "progress", "done": 3, "total": 10}\n')
        f.write('{"t": 2, "type": "progr')  # a line cut off mid-write
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.runs.get(run_dir.name) is not None)
        await pilot.pause()
        assert table_cell(app, run_dir.name, "status") == "crashed"  # no process behind it
        assert table_cell(app, run_dir.name, "progress") == "3/10 (30%)"
        assert "1 unreadable line(s) in events.jsonl were skipped" in widget_text(app, "#detail-progress")


async def test_run_directory_deleted_while_listed(runs_root: Path) -> None:
    run_dir = make_run(runs_root, ("started", {"pid": 1, "attempt": 1}), ("cancelled", {"message": "by request"}))
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.runs.get(run_dir.name) is not None)
        app.poller._timer.stop()  # hold the next poll so the deleted run is still listed
        shutil.rmtree(run_dir)
        await pilot.press("l")
        assert any("no longer exists" in n for n in notifications(app))
        assert not isinstance(app.screen, LogScreen)
        await wait_for(pilot, lambda: app.runs.get(run_dir.name) is None)
        await pilot.pause()
        assert app.screen.query_one("#runs-table", RunsTable).row_count == 0
        assert f"No runs yet in {runs_root}" in flat_text(app)


async def test_cancel_asks_then_signals_the_process_group(live_run: tuple[Path, subprocess.Popen[bytes]]) -> None:
    run_dir, proc = live_run
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: (info := app.runs.get(run_dir.name)) is not None and info.active)
        await pilot.pause()
        assert table_cell(app, run_dir.name, "status") == "running"
        await pilot.press("c")
        assert isinstance(app.screen, ConfirmDialog)
        await pilot.press("n")
        assert proc.poll() is None  # "no" leaves it running
        await pilot.press("c")
        await pilot.press("y")
        proc.wait(timeout=10)
        assert proc.returncode == -signal.SIGTERM
        await wait_for(pilot, lambda: table_cell(app, run_dir.name, "status") == "crashed")
        assert any("cancelling" in n for n in notifications(app))


async def test_resume_with_an_unreadable_frozen_profile_says_why(runs_root: Path) -> None:
    run_dir = make_run(runs_root, ("started", {"pid": 1, "attempt": 1}), ("failed", {"message": "boom"}))
    (run_dir / "profile.toml").write_text("kind = [", encoding="utf-8")
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.runs.get(run_dir.name) is not None)
        await pilot.pause()
        await pilot.press("s")
        await pilot.pause()
        assert any("profile.toml" in n and "not valid TOML" in n for n in notifications(app))
        assert app.is_running


async def test_delete_asks_first(runs_root: Path) -> None:
    run_dir = make_run(runs_root, ("started", {"pid": 1, "attempt": 1}), ("failed", {"message": "boom"}))
    app = make_app(screen="runs")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.runs.get(run_dir.name) is not None)
        await pilot.pause()
        await pilot.press("x", "n")
        assert run_dir.exists()
        await pilot.press("x", "y")
        assert not run_dir.exists()
        await wait_for(pilot, lambda: app.runs.get(run_dir.name) is None)


async def test_log_viewer_and_dashboard_open_the_selected_run(runs_root: Path) -> None:
    for message in ("first", "second"):
        run_dir = make_run(runs_root, ("started", {"pid": 1, "attempt": 1}), ("failed", {"message": message}))
        (run_dir / "log.txt").write_text(f"the log of {run_dir.name}\n", encoding="utf-8")
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: len(app.runs.runs) == 2)
        await pilot.pause()
        second_row = app.runs.runs[1].id
        await pilot.press("tab", "down", "enter")  # the dashboard's table: open the second run
        await wait_for(pilot, lambda: app.current_mode == "runs")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, RunsScreen)
        assert screen.table.selected_id == second_row
        await pilot.press("l")
        assert isinstance(app.screen, LogScreen)
        await pilot.pause()
        assert f"the log of {second_row}" in log_lines(app, "#log-full")
        await pilot.press("escape")
        assert app.screen is screen


async def test_idle_polls_redraw_nothing(runs_root: Path) -> None:
    make_run(runs_root, ("started", {"pid": 1, "attempt": 1}), ("finished", {"summary": {}}))
    polls: list[RunsPolled] = []
    app = make_app(screen="runs")
    hook = lambda message: polls.append(message) if isinstance(message, RunsPolled) else None  # noqa: E731
    async with app.run_test(size=(120, 40), message_hook=hook) as pilot:
        await wait_for(pilot, lambda: len(app.runs.runs) == 1)
        screen = app.screen
        updates: list[object] = []
        screen.runs_updated = updates.append  # type: ignore[method-assign]
        seen = len(polls)
        await pilot.pause(2.5)
        idle = polls[seen:]
        assert 2 <= len(idle) <= 3  # one poll a second while no run is active, never two at once
        assert not any(p.changed for p in idle)
        assert updates == []  # nothing changed, so nothing was redrawn
