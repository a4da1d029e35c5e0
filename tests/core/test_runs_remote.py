"""A run directory on a shared filesystem seen from another host: its status comes from its events alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.io import profile_from_data
from gpuopt_tui.core.runs.events import EventWriter
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.lifecycle import cancel_run, create_run
from gpuopt_tui.core.runs.status import RunWatcher, this_host

NO_SUCH_PID = 2**22 + 12345  # above Linux's default pid_max: no process here has it


def started_elsewhere(tmp_path: Path, host: str) -> Path:
    run_dir = create_run(profile_from_data({"kind": "attribution"}, "p.toml"), root=tmp_path)
    RunDir(run_dir).pid.write_text(json.dumps({"pid": NO_SUCH_PID, "attempt": 1, "host": host}))
    events = EventWriter(RunDir(run_dir).events)
    events.emit("started", pid=NO_SUCH_PID, attempt=1, host=host)
    events.close()
    return run_dir


def test_a_run_on_another_host_is_running_until_its_events_say_otherwise(tmp_path: Path) -> None:
    run_dir = started_elsewhere(tmp_path, "compute-node-7")
    info = RunWatcher(tmp_path).info(run_dir)
    assert info.status == "running" and info.remote and info.pids() == []
    with pytest.raises(UserError, match="runs on compute-node-7; cancel it there"):
        cancel_run(run_dir)
    events = EventWriter(RunDir(run_dir).events)
    events.emit("finished", summary={})
    events.close()
    assert RunWatcher(tmp_path).info(run_dir).status == "finished"


def test_a_run_of_this_host_whose_process_is_gone_crashed(tmp_path: Path) -> None:
    info = RunWatcher(tmp_path).info(started_elsewhere(tmp_path, this_host()))
    assert info.status == "crashed" and not info.remote and info.pids() == [NO_SUCH_PID]
