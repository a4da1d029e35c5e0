"""Damaged, planted or huge run-directory files: the run is shown as damaged with the reason, every other run
and command keeps working, nothing from a file reaches the terminal raw, and run ids are never paths."""

from __future__ import annotations

import json
import os
import shutil
import tracemalloc
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpuopt_tui import cli
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.io import profile_from_data
from gpuopt_tui.core.runs.events import EventWriter
from gpuopt_tui.core.runs.files import remove_stale_partial_writes
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.lifecycle import cancel_run, create_run, find_run, launch, resume_run, start_run
from gpuopt_tui.core.runs.status import RunWatcher

NO_PROCESS = 2**22 + 1  # a valid pid above Linux's pid_max: no process has it


@pytest.fixture
def runs_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "runs"
    monkeypatch.setenv("GPUOPT_TUI_RUNS_DIR", str(root))
    monkeypatch.setenv("COLUMNS", "400")  # table cells unfolded
    return root


def finished_run(root: Path, name: str = "good") -> Path:
    run_dir = create_run(profile_from_data({"kind": "attribution", "name": name}, "p.toml"), root=root)
    RunDir(run_dir).pid.write_text(json.dumps({"pid": NO_PROCESS, "start_time": None, "attempt": 1}))
    events = EventWriter(RunDir(run_dir).events)
    events.emit("started", attempt=1)
    events.emit("finished", summary={"samples": 3})
    events.close()
    return run_dir


def gpuopt(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """Run the CLI in this process: exit code and everything it printed, whitespace collapsed."""
    code = cli.main(list(args))
    out = capsys.readouterr()
    return code, " ".join((out.out + out.err).split())


def assert_clean(output: str) -> None:
    assert "internal error" not in output and "Traceback" not in output and "\x1b" not in output


META_DAMAGE = {
    "created null": ({"created": None}, "'created' is null; expected a time"),
    "created text": ({"created": "yesterday"}, "'created' is \"yesterday\""),
    "created list": ({"created": [1, 2]}, "'created' is [1, 2]"),
    "created NaN": ({"created": float("nan")}, "'created' is NaN"),
    "created true": ({"created": True}, "'created' is true"),
    "kind number": ({"kind": 5}, "'kind' is 5; expected a run kind"),
    "kind empty": ({"kind": ""}, "'kind' is \"\""),
    "name list": ({"name": ["a"]}, "'name' is [\"a\"]; expected text"),
    "id number": ({"id": 3}, "'id' is 3"),
    "source object": ({"source": {"a": 1}}, "'source' is {\"a\": 1}"),
}
RAW_META = {
    "a list": (b"[]", "meta.json holds [], not a JSON object"),
    "null": (b"null", "meta.json holds null"),
    "cut short": (b'{"kind": "attri', "meta.json is not valid JSON"),
    "binary": (b"\xff\xfe\x00garbage", "meta.json is not valid JSON"),
    "deeply nested": (b"[" * 100_000, "meta.json is not valid JSON"),
}


def damage_meta(run_dir: Path, change: dict[str, object] | bytes) -> None:
    path = RunDir(run_dir).meta
    if isinstance(change, bytes):
        path.write_bytes(change)
    else:
        path.write_text(json.dumps({**json.loads(path.read_text()), **change}))


@pytest.mark.parametrize("change, reason", [*META_DAMAGE.values(), *RAW_META.values()], ids=[*META_DAMAGE, *RAW_META])
def test_a_damaged_meta_is_listed_as_damaged_beside_the_other_runs(
    change: dict[str, object] | bytes, reason: str, runs_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, bad = finished_run(runs_root), finished_run(runs_root, "bad")
    damage_meta(bad, change)
    infos = {i.id: i for i in RunWatcher(runs_root).refresh()}
    assert infos[good.name].status == "finished"
    assert infos[bad.name].status == "damaged" and reason in infos[bad.name].message
    code, listed = gpuopt(capsys, "runs")
    assert code == 0 and good.name in listed and bad.name in listed and "damaged" in listed
    code, shown = gpuopt(capsys, "show", bad.name)
    assert code == 0 and "status: damaged" in shown and reason in shown
    for output in (listed, shown):
        assert_clean(output)


def test_a_meta_json_that_is_a_directory_is_damaged(runs_root: Path) -> None:
    bad = finished_run(runs_root)
    RunDir(bad).meta.unlink()
    RunDir(bad).meta.mkdir()
    (info,) = RunWatcher(runs_root).refresh()
    assert (info.status, info.message) == ("damaged", "meta.json is a directory, not a file")


def test_an_impossible_creation_time_is_shown_as_unknown(runs_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = finished_run(runs_root)
    damage_meta(run_dir, {"created": 1e300})
    code, listed = gpuopt(capsys, "runs")
    assert code == 0 and " finished ? runs directory: " in listed


PID_DAMAGE = {
    "pid text": ({"pid": "x"}, "pid.json: 'pid' is \"x\"; expected a process id"),
    "pid negative": ({"pid": -1}, "'pid' is -1"),
    "attempt text": ({"attempt": "2"}, "'attempt' is \"2\""),
    "start time text": ({"start_time": "x"}, "'start_time' is \"x\""),
    "host number": ({"host": 5}, "'host' is 5"),
}


@pytest.mark.parametrize("change, reason", PID_DAMAGE.values(), ids=list(PID_DAMAGE))
def test_a_damaged_pid_record_is_listed_as_damaged(change: dict[str, object], reason: str, runs_root: Path) -> None:
    run_dir = finished_run(runs_root)
    record = json.loads(RunDir(run_dir).pid.read_text())
    RunDir(run_dir).pid.write_text(json.dumps({**record, **change}))
    info = RunWatcher(runs_root).info(run_dir)
    assert info.status == "damaged" and reason in info.message


def test_an_events_file_that_is_a_directory_is_damaged(runs_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = finished_run(runs_root)
    RunDir(run_dir).events.unlink()
    RunDir(run_dir).events.mkdir()
    info = RunWatcher(runs_root).info(run_dir)
    assert info.status == "damaged" and info.message == "cannot read events.jsonl (Is a directory)"
    code, output = gpuopt(capsys, "cancel", run_dir.name, "--wait", "0")
    assert code == 1 and "is not running (it is damaged)" in output


def test_event_fields_of_the_wrong_type_are_ignored(runs_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = finished_run(runs_root)
    lines = [
        {"t": "x", "type": "started", "attempt": "yesterday", "host": ["a"]},
        {"t": 1, "type": "rank_started", "rank": [1], "pid": "abc", "start_time": {}, "host": None},
        {"t": 2, "type": "progress", "rank": "x", "done": "7", "total": [9], "rate": "fast", "gpu_reserved": "1 GB"},
        {"t": 3, "type": "progress", "done": float("nan"), "total": float("inf"), "eta": -float("inf")},
        {"t": 4, "type": "artifact", "path": 5},
        {"t": 5, "type": "finished", "summary": [1], "message": "\x1b]0;owned\x07\x1b[2J done"},
    ]
    RunDir(run_dir).events.write_text("".join(json.dumps(e) + "\n" for e in lines))
    info = RunWatcher(runs_root).info(run_dir)
    assert (info.status, info.summary, info.started) == ("finished", {}, None)
    assert info.message == "?]0;owned??[2J done"
    for args in (["runs"], ["runs", "--json"], ["show", run_dir.name]):
        code, output = gpuopt(capsys, *args)
        assert code == 0
        assert_clean(output)


def test_text_from_run_files_is_never_markup_nor_escape_sequences(
    runs_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = finished_run(runs_root)
    damage_meta(run_dir, {"name": "[/] [bold red]\x1b[31mred\x1b[0m", "kind": "[link=x]k"})
    code, output = gpuopt(capsys, "runs")
    assert code == 0 and "?[31mred?[0m" in output
    code, output = gpuopt(capsys, "show", run_dir.name)
    assert code == 0 and "[/] [bold red]?[31mred?[0m" in output and "[link=x]k" in output
    assert_clean(output)


@pytest.mark.parametrize("run_id", ["../evil", "/tmp", "a/b", "..", ".", "", "-x", "x\x1b[2J"])
@pytest.mark.parametrize("command", ["show", "cancel", "resume", "attach"])
def test_run_ids_are_plain_names_never_paths(
    command: str, run_id: str, runs_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    evil = runs_root.parent / "evil"  # a run directory outside the runs directory
    if not evil.exists():
        shutil.copytree(finished_run(runs_root), evil)
    code, output = gpuopt(capsys, command, "--", run_id) if run_id.startswith("-") else gpuopt(capsys, command, run_id)
    assert code == 1 and "is not a run id: ids are plain names" in output
    assert_clean(output)


def test_an_unreadable_runs_directory_is_a_clear_error(
    runs_root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    finished_run(runs_root)

    def refused(path: object) -> object:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("gpuopt_tui.core.runs.status.os.scandir", refused)
    for args in (["runs"], ["show", "2"]):
        code, output = gpuopt(capsys, *args)
        assert code == 1 and f"cannot read the runs directory {runs_root} (Permission denied)" in output
        assert_clean(output)


def test_runs_limit_is_a_count_and_zero_means_all(runs_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = [finished_run(runs_root, f"run{i}") for i in range(3)]
    code, output = gpuopt(capsys, "runs", "--limit", "0")
    assert code == 0 and all(r.name in output for r in runs)
    code, output = gpuopt(capsys, "runs", "--limit", "1")
    assert code == 0 and "2 older run(s) not shown" in output
    for bad in ("-1", "x"):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["runs", "--limit", bad])
        assert exit_.value.code == 2 and "expected a whole number of runs, 0 for all" in capsys.readouterr().err


def test_cancel_wait_must_be_a_number_of_seconds(runs_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("nan", "-1", "inf"):
        with pytest.raises(SystemExit):
            cli.main(["cancel", "x", "--wait", bad])
        assert "expected a number of seconds >= 0" in capsys.readouterr().err


def test_partial_writes_are_not_results_and_stale_ones_are_removed(
    runs_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = finished_run(runs_root)
    results = RunDir(run_dir).results
    (results / "attributions.jsonl").write_text("{}\n")
    stale = results / f".attributions.jsonl.{NO_PROCESS}.tmp"  # a writer killed mid-write
    live = RunDir(run_dir).state / f".batch-1.pt.{os.getpid()}.tmp"  # a write in progress
    stale.write_text("{")
    live.write_text("{")
    code, output = gpuopt(capsys, "show", run_dir.name)
    assert code == 0 and "attributions.jsonl" in output and ".tmp" not in output
    remove_stale_partial_writes(run_dir)
    assert not stale.exists() and live.exists()


DiskUsage = namedtuple("DiskUsage", "total used free")


def test_a_crash_with_an_empty_log_says_what_may_have_happened(
    runs_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = create_run(profile_from_data({"kind": "attribution"}, "p.toml"), root=runs_root)
    RunDir(run_dir).pid.write_text(json.dumps({"pid": NO_PROCESS, "attempt": 1}))
    RunDir(run_dir).log.write_text("")
    watcher = RunWatcher(runs_root)
    assert "its log is empty (it was killed, or could not write to" in watcher.info(run_dir).message
    monkeypatch.setattr("gpuopt_tui.core.runs.files.shutil.disk_usage", lambda path: DiskUsage(10**9, 10**9, 512))
    info = watcher.info(run_dir)
    assert info.status == "crashed" and f"the disk of {run_dir} is full (512 B free)" in info.message
    with pytest.raises(UserError, match=r"is full \(512 B free\): free some space, then resume"):
        launch(run_dir)
    assert json.loads(RunDir(run_dir).pid.read_text())["pid"] == NO_PROCESS  # nothing was started
    RunDir(run_dir).log.write_text("Traceback ...\n")
    assert watcher.info(run_dir).message.endswith("; see its log")


def test_a_run_that_could_not_start_can_be_resumed_at_once(runs_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as full:
        full.setattr("gpuopt_tui.core.runs.files.shutil.disk_usage", lambda path: DiskUsage(10**9, 10**9, 512))
        with pytest.raises(UserError, match=r"is full \(512 B free\): free some space, then resume"):
            start_run(profile_from_data({"kind": "attribution"}, "p.toml"), root=runs_root)
    [run_dir] = RunWatcher(runs_root).run_dirs()
    info = RunWatcher(runs_root).info(run_dir)
    assert info.status == "failed" and "could not start: the disk of" in info.message
    with pytest.raises(UserError, match="is not running \\(it is failed\\)"):
        cancel_run(run_dir)
    launched: list[Path] = []
    monkeypatch.setattr("gpuopt_tui.core.runs.lifecycle.launch", lambda path: launched.append(path) or 1)
    resume_run(run_dir)
    assert launched == [run_dir]


def test_a_run_directory_that_could_not_be_made_whole_is_removed(
    runs_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(path: Path, text: str) -> None:
        raise UserError(f"{path}: cannot write it (No space left on device); nothing was written")

    monkeypatch.setattr("gpuopt_tui.core.runs.lifecycle.atomic_write_text", full)
    with pytest.raises(UserError, match="No space left on device"):
        start_run(profile_from_data({"kind": "attribution"}, "p.toml"), root=runs_root)
    assert list(runs_root.iterdir()) == []


def test_a_huge_events_file_is_read_in_bounded_memory(runs_root: Path) -> None:
    run_dir = create_run(profile_from_data({"kind": "attribution"}, "p.toml"), root=runs_root)
    RunDir(run_dir).pid.write_text(json.dumps({"pid": NO_PROCESS, "attempt": 1}))

    def line(**event: object) -> bytes:
        return (json.dumps(event) + "\n").encode()

    progress = b"".join(line(t=1.5, type="progress", done=i, total=10**6, unit="samples") for i in range(1000))
    with RunDir(run_dir).events.open("wb") as f:
        f.write(line(t=1.0, type="started", attempt=1))
        for _ in range(6):  # ~4 MB of progress each
            f.write(progress * 60)
            f.write(line(t=2.0, type="artifact", path="results/part.jsonl"))
        f.write(line(t=3.0, type="progress", done=999_999, total=10**6))
        f.write(line(t=4.0, type="failed", message="out of memory"))
    assert RunDir(run_dir).events.stat().st_size > 24 * 2**20
    tracemalloc.start()
    try:
        info = RunWatcher(runs_root).info(run_dir)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (info.status, info.message, info.started, info.artifacts) == ("failed", "out of memory", 1.0, 6)
    assert info.progress["done"] == 999_999
    assert peak < 12 * 2**20  # the file is more than twice that


def test_find_run_takes_an_exact_id_before_a_prefix(runs_root: Path) -> None:
    first = finished_run(runs_root)
    longer = runs_root / f"{first.name}x"
    shutil.copytree(first, longer)
    assert find_run(first.name) == first
    with pytest.raises(UserError, match="ambiguous"):
        find_run(first.name[:-1])


@pytest.mark.parametrize("damage", ["deleted", "meta damaged"])
def test_attach_stops_when_the_run_directory_goes(
    damage: str, runs_root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = create_run(profile_from_data({"kind": "attribution"}, "p.toml"), root=runs_root)
    RunDir(run_dir).pid.write_text(json.dumps({"pid": os.getpid(), "attempt": 1}))  # a live process: running
    EventWriter(RunDir(run_dir).events).emit("started", attempt=1)
    polls: list[float] = []

    def poll(seconds: float) -> None:  # instead of waiting between polls: the directory goes after the first
        polls.append(seconds)
        assert len(polls) < 20, "still following a run whose directory is gone"
        if damage == "deleted":
            shutil.rmtree(run_dir, ignore_errors=True)
        else:
            RunDir(run_dir).meta.write_text("{")

    monkeypatch.setattr("gpuopt_tui.commands.follow.time", SimpleNamespace(sleep=poll))
    code, output = gpuopt(capsys, "attach", run_dir.name)
    assert code == 1 and len(polls) == 1
    expected = "was deleted; stopped following" if damage == "deleted" else "meta.json is not valid JSON"
    assert expected in output
    assert_clean(output)
