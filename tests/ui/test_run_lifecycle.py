"""A run started from the TUI outlives the TUI: started from the attribution screen in one app process, that
process is killed with SIGKILL, the run goes on, and a new app shows its live progress and cancels it.

This uses the real attribution engine on the demo model (CPU, one thread), made slow enough to watch:
2000 interpolation steps, one sample per batch."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuopt_tui.app import make_app
from gpuopt_tui.core.kinds import KINDS
from gpuopt_tui.core.runs.status import RunWatcher

from .conftest import pid_alive, wait_for

ENGINE = KINDS["attribution"].engine_file

TUI_STARTS_A_RUN = """
import asyncio, json, sys
from gpuopt_tui.app import make_app

async def main():
    app = make_app(screen="attribution")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        for key, value in (("attribution.n_steps", "2000"), ("attribution.batch_size", "1")):
            field = app.screen.form.edit_key(key)  # focused
            field.value = ""
            await pilot.press(*value)
        await pilot.press("escape", "ctrl+r")
        while not (app.runs.latest("attribution") and app.runs.latest("attribution").active):
            await pilot.pause()
        print(json.dumps({"run": app.runs.latest("attribution").id}), flush=True)
        await asyncio.sleep(600)  # until killed

asyncio.run(main())
"""


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the TUI did not start a run in time"
    return proc.stdout.readline()


@pytest.mark.slow
@pytest.mark.skipif(
    not ENGINE.is_file(), reason="the attribution engine (jobs/attribution/job.py) is not in this build"
)
async def test_run_survives_sigkill_of_the_tui_and_a_new_tui_reattaches(runs_root: Path) -> None:
    tui = subprocess.Popen(
        [sys.executable, "-c", TUI_STARTS_A_RUN], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        run_id = json.loads(_read_line(tui, timeout=60))["run"]
    finally:
        tui.send_signal(signal.SIGKILL)
        tui.wait()
    run_dir = runs_root / run_id
    pid = json.loads((run_dir / "pid.json").read_text())["pid"]
    assert pid_alive(pid), "the run died with the TUI"

    # the attribution starts once torch is loaded and the demo model is built (cached after once: stages of their
    # own); the run must stay alive until then and after
    watcher = RunWatcher(runs_root)
    deadline = time.monotonic() + 90
    while watcher.info(run_dir).progress.get("stage") != "attribution" and time.monotonic() < deadline:
        assert watcher.info(run_dir).active, (run_dir / "log.txt").read_text()
        time.sleep(0.5)

    app = make_app(screen="runs")
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: (i := app.runs.get(run_id)) is not None and bool(i.progress), 30)
            first = app.runs.get(run_id)
            assert first is not None and first.status == "running"
            done = first.progress["done"]
            await wait_for(pilot, lambda: app.runs.get(run_id).progress["done"] > done, 30)  # type: ignore[union-attr]
            await pilot.pause()
            text = app.screen.query_one("#detail-progress").content  # type: ignore[attr-defined]
            assert "samples/s" in str(text) and "ETA" in str(text)

            await pilot.press("c", "y")  # cancel from the new TUI
            await wait_for(pilot, lambda: app.runs.get(run_id).status == "cancelled", 60)  # type: ignore[union-attr]
            await wait_for(pilot, lambda: not pid_alive(pid), 30)  # the job exits after writing `cancelled`
    finally:
        if pid_alive(pid):
            os.killpg(pid, signal.SIGKILL)
