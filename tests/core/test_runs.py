"""Run directories and statuses, derived from events and process liveness."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuopt_tui.core.atomic import atomic_write_text
from gpuopt_tui.core.errors import ProfileError, UserError
from gpuopt_tui.core.profile_paths import resolve_paths
from gpuopt_tui.core.profiles.io import load_profile, parse_toml, profile_from_data
from gpuopt_tui.core.runs.events import EventWriter
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.lifecycle import cancel_run, create_run, find_run, resume_run
from gpuopt_tui.core.runs.processes import JOB_MODULE, pid_alive
from gpuopt_tui.core.runs.status import RunWatcher


@pytest.fixture
def runs_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "runs"
    monkeypatch.setenv("GPUOPT_TUI_RUNS_DIR", str(root))
    return root


def make_run(runs_root: Path, **data: object) -> Path:
    profile = profile_from_data({"kind": "attribution", **data}, "demo.toml")
    return create_run(profile, source=runs_root.parent / "profiles" / "demo.toml", root=runs_root)


def sleeper(run_dir: Path | None = None) -> subprocess.Popen[bytes]:
    """A process in its own session; started with the job module and `run_dir`, it passes as that run's process."""
    args = ["-m", JOB_MODULE, str(run_dir)] if run_dir else []
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *args], start_new_session=True)


def set_pid(run_dir: Path, proc: subprocess.Popen[bytes] | None, attempt: int = 1) -> None:
    pid = proc.pid if proc else 999_999_999
    RunDir(run_dir).pid.write_text(json.dumps({"pid": pid, "start_time": None, "attempt": attempt}))


def test_create_run_freezes_profile_with_absolute_paths(runs_root: Path) -> None:
    data_file = runs_root.parent / "profiles" / "data" / "x.jsonl"
    data_file.parent.mkdir(parents=True)
    data_file.write_text('{"text": "a b", "label": 1}\n')
    run_dir = make_run(runs_root, data={"source": "jsonl", "path": "data/x.jsonl"})
    frozen = load_profile(RunDir(run_dir).profile)
    assert frozen.data.path == str(data_file.resolve())
    meta = json.loads(RunDir(run_dir).meta.read_text())
    assert meta["kind"] == "attribution" and meta["id"] == run_dir.name
    assert RunDir(run_dir).results.is_dir() and RunDir(run_dir).state.is_dir()


def test_missing_files_are_reported_before_launch(runs_root: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"key 'model.path': .*nope: no such file or directory"):
        make_run(runs_root, model={"adapter": "hf", "path": str(tmp_path / "nope")})
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="expected a model directory with a config.json"):
        make_run(runs_root, model={"adapter": "hf", "path": str(tmp_path / "empty")})
    with pytest.raises(UserError, match=r"key 'data.path': .*missing.jsonl"):
        make_run(runs_root, data={"source": "jsonl", "path": "missing.jsonl"})
    assert not runs_root.exists() or not any(runs_root.iterdir())


def test_plan_stage_files_are_resolved_and_checked(tmp_path: Path) -> None:
    profiles = tmp_path / "profiles"
    (profiles / "stages").mkdir(parents=True)
    (profiles / "stages" / "one.yaml").write_text("n_positives: 1\nn_negatives: 2\n")
    (profiles / "two.yaml").write_text("n_positives: 3\nn_negatives: 4\n")
    data = {"kind": "plan", "model": {"adapter": "demo"}, "plan": {"stages": ["stages/one.yaml", "two.yaml"]}}
    profile = profile_from_data(data, "plan.toml")
    resolve_paths(profile, profiles, "plan.toml")
    assert profile.plan.stages == [str(profiles / "stages" / "one.yaml"), str(profiles / "two.yaml")]
    missing = profile_from_data({**data, "plan": {"stages": ["two.yaml", "gone.yaml"]}}, "plan.toml")
    with pytest.raises(ProfileError, match=r"key 'plan.stages\[1\]': .*gone.yaml: no such file or directory"):
        resolve_paths(missing, profiles, "plan.toml")


def test_status_follows_events_and_liveness(runs_root: Path) -> None:
    run_dir = make_run(runs_root)
    watcher = RunWatcher(runs_root)
    proc = sleeper()
    try:
        set_pid(run_dir, proc)
        assert watcher.info(run_dir).status == "starting"
        events = EventWriter(RunDir(run_dir).events)
        events.emit("started", pid=proc.pid, attempt=1)
        events.progress(force=True, done=3, total=10, rate=1.5, eta=4.0)
        info = watcher.info(run_dir)
        assert (info.status, info.progress["done"], info.fraction) == ("running", 3, 0.3)
        events.emit("failed", message="CUDA out of memory at batch 4")
        info = watcher.info(run_dir)
        assert (info.status, info.message) == ("failed", "CUDA out of memory at batch 4")
    finally:
        proc.kill()
        proc.wait()


def test_dead_process_without_final_event_is_crashed(runs_root: Path) -> None:
    run_dir = make_run(runs_root)
    EventWriter(RunDir(run_dir).events).emit("started", pid=1, attempt=1)
    set_pid(run_dir, None)
    info = RunWatcher(runs_root).info(run_dir)
    assert info.status == "crashed" and "log" in info.message


def test_deleted_and_corrupt_runs_are_reported_not_raised(runs_root: Path) -> None:
    run_dir = make_run(runs_root)
    RunDir(run_dir).events.write_bytes(b'{"t": 1, "type": "started", "attempt": 1}\n\x00\xff garbage\n{"t": 2, "ty')
    set_pid(run_dir, None)
    watcher = RunWatcher(runs_root)
    info = watcher.info(run_dir)
    assert info.corrupt_lines == 1 and info.status == "crashed"
    RunDir(run_dir).meta.unlink()
    assert watcher.info(run_dir).status == "missing"
    assert watcher.refresh() == []


def test_cancel_signals_the_process_group(runs_root: Path) -> None:
    run_dir = make_run(runs_root)
    proc = sleeper(run_dir)
    set_pid(run_dir, proc)
    EventWriter(RunDir(run_dir).events).emit("started", pid=proc.pid, attempt=1)
    cancel_run(run_dir)
    assert proc.wait(timeout=10) == -signal.SIGTERM
    with pytest.raises(UserError, match="not running"):
        cancel_run(run_dir)


def test_resume_only_stopped_runs(runs_root: Path) -> None:
    run_dir = make_run(runs_root)
    EventWriter(RunDir(run_dir).events).emit("finished", summary={})
    set_pid(run_dir, None)
    with pytest.raises(UserError, match="only cancelled, failed or crashed"):
        resume_run(run_dir)


def test_find_run_by_prefix(runs_root: Path) -> None:
    run_dir = make_run(runs_root)
    assert find_run(run_dir.name[:-2], runs_root) == run_dir
    with pytest.raises(UserError, match="no run"):
        find_run("nope", runs_root)


def test_unwritable_runs_dir_is_a_clear_error(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        blocked = tmp_path / "file-not-dir"
        blocked.write_text("")  # root ignores permissions; a file in the way fails for everyone
        root = blocked / "runs"
    else:
        root = tmp_path / "ro"
        root.mkdir(mode=0o500)
    profile = profile_from_data(parse_toml('kind = "attribution"', "x"), "x.toml")
    with pytest.raises(UserError, match="cannot create the run directory.*--runs-dir"):
        create_run(profile, root=root)


def test_pid_alive_detects_exit_and_reuse() -> None:
    proc = sleeper()
    assert pid_alive(proc.pid)
    assert not pid_alive(proc.pid, start_time=1)  # another process's start time: a reused pid
    proc.kill()
    proc.wait()
    time.sleep(0.05)
    assert not pid_alive(proc.pid)


def test_meta_is_parsed_again_only_when_the_file_changes(runs_root: Path) -> None:
    run_dir = make_run(runs_root, name="first")
    meta_path = RunDir(run_dir).meta
    watcher = RunWatcher(runs_root)
    assert watcher.refresh()[0].name == "first"
    stat = meta_path.stat()
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "name": "other"}).ljust(stat.st_size))  # same size, inode, mtime
    os.utime(meta_path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert watcher.refresh()[0].name == "first"  # not read again: the cached copy is used
    os.utime(meta_path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert watcher.refresh()[0].name == "other"
    meta_path.write_text("{not json")
    damaged = watcher.refresh()[0]
    assert damaged.status == "damaged" and damaged.message.startswith("meta.json is not valid JSON")


def test_started_is_the_start_of_the_current_attempt(runs_root: Path) -> None:
    run_dir = make_run(runs_root)
    set_pid(run_dir, None, attempt=2)
    events = RunDir(run_dir).events
    watcher = RunWatcher(runs_root)
    assert watcher.info(run_dir).started is None
    lines = [
        {"t": 100.0, "type": "started", "attempt": 1},
        {"t": 160.0, "type": "cancelled", "message": "by request"},
        {"t": 5000.0, "type": "started", "attempt": 2},  # resumed more than an hour later
        {"t": 5030.0, "type": "finished", "summary": {}},
    ]
    events.write_text("".join(json.dumps(e) + "\n" for e in lines[:2]))
    assert (watcher.info(run_dir).started, watcher.info(run_dir).ended) == (100.0, 160.0)
    with events.open("a") as f:
        f.write("".join(json.dumps(e) + "\n" for e in lines[2:]))
    info = watcher.info(run_dir)
    assert (info.status, info.attempt, info.started, info.ended) == ("finished", 2, 5000.0, 5030.0)


def test_runs_of_the_same_second_are_ordered_by_creation_time(runs_root: Path) -> None:
    created = {"ffff": 1_800_000_000.25, "0000": 1_800_000_000.75}  # the later one has the smaller random part
    for suffix, t in created.items():
        run_dir = runs_root / f"20270115-080000-attribution-{suffix}"
        run_dir.mkdir(parents=True)
        RunDir(run_dir).meta.write_text(json.dumps({"id": run_dir.name, "kind": "attribution", "created": t}))
        set_pid(run_dir, None)
        EventWriter(RunDir(run_dir).events).emit("finished", summary={})
    assert [i.id[-4:] for i in RunWatcher(runs_root).refresh()] == ["0000", "ffff"]


def test_finished_runs_are_listed_without_looking_up_their_process(
    runs_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = make_run(runs_root)
    set_pid(run_dir, None)
    writer = EventWriter(RunDir(run_dir).events)
    writer.emit("started", attempt=1)
    writer.emit("finished", summary={"n": 1})
    looked_up: list[int] = []
    monkeypatch.setattr("gpuopt_tui.core.runs.status.pid_alive", lambda pid, start=None: looked_up.append(pid) or False)
    watcher = RunWatcher(runs_root)
    assert [(i.status, i.summary) for i in watcher.refresh()] == [("finished", {"n": 1})]
    assert looked_up == []
    resumed = {"pid": 999_999_999, "start_time": None, "attempt": 2}
    atomic_write_text(RunDir(run_dir).pid, json.dumps(resumed))  # as launch() writes it; the new attempt decides
    assert watcher.refresh()[0].status == "finished" and looked_up == [999_999_999]
