"""Traces: writing, reading (tolerating a cut-off recording), replay timing, and the replay source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.telemetry import (
    GpuSample,
    ProcessSample,
    ReplaySource,
    Snapshot,
    TraceWriter,
    open_source,
    read_trace,
    replay,
)
from gpuopt_tui.core.telemetry.replay import Redactor

SYNTHETIC = Path(__file__).parents[1] / "fixtures" / "traces" / "synthetic_3gpu.jsonl"


def snapshot(t: float, used: int | None = 1 << 30) -> Snapshot:
    gpu = GpuSample(index=0, name="card", memory_used=used, memory_total=8 << 30, util_sm=50, fan=None)
    process = ProcessSample(pid=42, gpu_index=0, gpu_memory=None, user="me", command="python x.py", run_id="r1")
    return Snapshot(time=t, gpus=(gpu,), processes=(process,), notes=("a note",))


def write(path: Path, snapshots: list[Snapshot]) -> None:
    with TraceWriter(path, {"interval": 1.0, "host": "test"}) as trace:
        for s in snapshots:
            trace.write(s)


def test_a_written_trace_reads_back_identical(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    original = [snapshot(100.0), snapshot(101.0, used=None), Snapshot(time=102.0, message="gone")]
    write(path, original)
    trace = read_trace(path)
    assert trace.header["host"] == "test" and trace.header["format"] == "gpuopt-tui-gpu-trace"
    assert trace.snapshots == original
    assert trace.duration == 2.0


def test_a_trace_cut_off_mid_line_is_read_up_to_the_last_full_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write(path, [snapshot(1.0), snapshot(2.0)])
    with path.open("a") as f:
        f.write('{"t": 3.0, "gpus": [{"ind')
    assert [s.time for s in read_trace(path).snapshots] == [1.0, 2.0]


def test_unknown_fields_from_a_newer_version_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write(path, [snapshot(1.0)])
    lines = path.read_text().splitlines()
    data = json.loads(lines[1])
    data["gpus"][0]["encoder_util"] = 3
    data["power_total"] = 5
    path.write_text("\n".join([lines[0], json.dumps(data)]) + "\n")
    assert read_trace(path).snapshots[0].gpus[0].util_sm == 50


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "empty file"),
        ("not json\n", "line 1: invalid JSON"),
        ('{"format": "something-else"}\n', "line 1: expected a header"),
        ('{"format": "gpuopt-tui-gpu-trace", "version": 99}\n', "version 99 is not supported"),
        ('{"format": "gpuopt-tui-gpu-trace", "version": 1}\n', "holds no samples"),
        ('{"format": "gpuopt-tui-gpu-trace", "version": 1}\n{"gpus": []}\n', "line 2: not a GPU sample: field 't'"),
        ('{"format": "gpuopt-tui-gpu-trace", "version": 1}\n{"t": 1, "gpus": [{"index": 0}]}\n{bad\n', "line 3"),
    ],
)
def test_bad_traces_name_the_file_and_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(UserError, match=message) as error:
        read_trace(path)
    assert str(path) in str(error.value)


def test_a_missing_trace_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="cannot read trace"):
        read_trace(tmp_path / "nope.jsonl")


def test_the_writer_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("precious")
    with pytest.raises(UserError, match="already exists"):
        TraceWriter(path, {})
    assert path.read_text() == "precious"


def test_replay_keeps_the_original_spacing_divided_by_speed(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write(path, [snapshot(10.0), snapshot(10.5), snapshot(12.5)])
    trace = read_trace(path)
    slept: list[float] = []
    assert [s.time for s in replay(trace, speed=1.0, sleep=slept.append)] == [10.0, 10.5, 12.5]
    assert slept == [0.5, 2.0]
    slept.clear()
    list(replay(trace, speed=4.0, sleep=slept.append))
    assert slept == [0.125, 0.5]
    slept.clear()
    list(replay(trace, speed=None, sleep=slept.append))
    assert slept == []


def test_the_replay_source_steps_one_sample_per_poll_and_loops_forward() -> None:
    source = ReplaySource(SYNTHETIC, speed=None)
    frames = source.trace.snapshots
    polled = [source.poll() for _ in range(len(frames) + 2)]
    assert [p.gpus for p in polled[: len(frames)]] == [f.gpus for f in frames]
    assert polled[len(frames)].gpus == frames[0].gpus  # looped
    times = [p.time for p in polled]
    assert times == sorted(times) and len(set(times)) == len(times)  # still increasing after the loop
    assert source.live is False and "synthetic_3gpu.jsonl" in source.label


def test_the_replay_source_follows_the_clock_at_its_speed() -> None:
    now = [0.0]
    source = ReplaySource(SYNTHETIC, speed=2.0, clock=lambda: now[0])
    t0 = source.trace.snapshots[0].time
    assert source.poll().time == t0
    now[0] = 5.2  # 10.4 trace seconds
    assert source.poll().time == t0 + 10
    now[0] = 15.0  # 30 trace seconds: one pass is 29 s plus one 1 s gap, so the start again
    assert source.poll().time == t0 + 30


def test_a_finished_replay_without_loop_stays_on_the_last_sample() -> None:
    source = ReplaySource(SYNTHETIC, speed=None, loop=False)
    frames = source.trace.snapshots
    for _ in range(len(frames) + 3):
        last = source.poll()
    assert last.gpus == frames[-1].gpus and last.time == frames[-1].time


def test_open_source_replays_a_trace() -> None:
    source = open_source(SYNTHETIC, speed=None)
    assert isinstance(source, ReplaySource)
    assert len(source.poll().gpus) == 3


def test_the_synthetic_trace_covers_na_fields_a_lost_gpu_and_a_run() -> None:
    frames = read_trace(SYNTHETIC).snapshots
    assert read_trace(SYNTHETIC).header["synthetic"] is True
    assert any(g.lost for g in frames[-1].gpus) and not any(g.lost for g in frames[0].gpus)
    assert frames[0].gpus[1].temperature is None and frames[0].gpus[1].power_draw is None
    assert any(p.run_id for p in frames[0].processes)
    assert any(p.gpu_memory is None for p in frames[0].processes)


def test_redaction_hides_users_and_home_directories() -> None:
    processes = (
        ProcessSample(pid=1, gpu_index=0, user="alice", command="/home/alice/venv/bin/python /home/alice/x.py"),
        ProcessSample(pid=2, gpu_index=0, user="bob", command="/Users/bob/run.sh --out /data/bob"),
        ProcessSample(pid=3, gpu_index=1, user="alice", command=None),
        ProcessSample(pid=4, gpu_index=1, user=None, command="/usr/bin/python3"),
    )
    redact = Redactor()
    first = redact(Snapshot(time=1.0, processes=processes))
    assert [(p.user, p.command) for p in first.processes] == [
        ("user1", "~/venv/bin/python ~/x.py"),
        ("user2", "~/run.sh --out /data/bob"),
        ("user1", None),
        (None, "/usr/bin/python3"),
    ]
    later = redact(Snapshot(time=2.0, processes=processes[1:2]))
    assert later.processes[0].user == "user2"  # the same name keeps its alias across samples


HEADER = '{"format": "gpuopt-tui-gpu-trace", "version": 1}\n'


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        ('{"t": 1, "gpus": [5]}', r"line 2: not a GPU sample: field 'gpus\[0\]': expected an object, got 5"),
        ('{"t": 1, "gpus": {"index": 0}}', "field 'gpus': expected a list"),
        ('{"t": 1, "gpus": [{"name": "x"}]}', r"field 'gpus\[0\]\.index': missing"),
        ('{"t": 1, "gpus": [{"index": "0"}]}', r"field 'gpus\[0\]\.index': expected a whole number .*, got \"0\""),
        ('{"t": 1, "gpus": [{"index": 0, "memory_used": -1}]}', r"'gpus\[0\]\.memory_used': expected a whole"),
        ('{"t": 1, "gpus": [{"index": 0, "memory_used": 1e400}]}', r"'gpus\[0\]\.memory_used'"),
        ('{"t": 1, "gpus": [{"index": 0, "memory_total": 99999999999999999999999}]}', "memory_total"),
        ('{"t": 1, "gpus": [{"index": 0, "name": 5}]}', r"'gpus\[0\]\.name': expected a string, got 5"),
        ('{"t": 1, "gpus": [{"index": 0, "lost": "no"}]}', r"'gpus\[0\]\.lost': expected true or false"),
        ('{"t": 1, "gpus": [{"index": 0, "power_draw": "300"}]}', r"'gpus\[0\]\.power_draw': expected a number"),
        ('{"t": 1, "processes": [{"pid": 1}]}', r"'processes\[0\]\.gpu_index': missing"),
        ('{"t": 1, "processes": [{"pid": true, "gpu_index": 0}]}', r"'processes\[0\]\.pid'"),
        ('{"t": NaN}', "field 't': expected a unix time"),
        ('{"t": 1e300}', "field 't': expected a unix time"),
        ('{"t": "yesterday"}', "field 't': expected a unix time"),
        ('{"t": 1, "message": ["x"]}', "field 'message': expected a string"),
        ('{"t": 1, "notes": "x"}', "field 'notes': expected a list"),
        ('{"t": 1, "notes": [1]}', r"field 'notes\[0\]': expected a string"),
        ("[1, 2]", r"field '\(line\)': expected an object"),
        ("[" * 100_000 + "]" * 100_000, "line 2: invalid JSON"),
        ('{"t": ' + "1" * 5000 + "}", "line 2: invalid JSON"),
    ],
)
def test_every_field_is_checked_and_named(tmp_path: Path, sample: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(HEADER + sample + "\n")
    with pytest.raises(UserError, match=message) as error:
        read_trace(path)
    assert str(error.value).startswith(f"{path}: line 2: ")
    assert len(str(error.value)) < len(str(path)) + 200  # a value is quoted, never a whole line


def test_a_binary_file_is_not_a_trace(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(HEADER.encode() + b"\xff\xfe\x00garbage\n")
    with pytest.raises(UserError, match=r"not a GPU trace \(byte 49 is not UTF-8 text\)"):
        read_trace(path)


def test_text_from_a_trace_has_its_control_characters_shown_as_question_marks(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    sample = {
        "t": 1,
        "gpus": [{"index": 0, "name": "\x1b[31mH100\x07", "uuid": "GPU-\x9b1m"}],
        "processes": [{"pid": 3, "gpu_index": 0, "user": "\x1b]0;x", "command": "run\x1b[2J", "run_id": "\x00r"}],
        "message": "\x1bc",
        "notes": ["\x1b[5m"],
    }
    path.write_text(HEADER + json.dumps(sample) + "\n")
    (snap,) = read_trace(path).snapshots
    assert (snap.gpus[0].name, snap.gpus[0].uuid) == ("?[31mH100?", "GPU-?1m")
    process = snap.processes[0]
    assert (process.user, process.command, process.run_id) == ("?]0;x", "run?[2J", "?r")
    assert (snap.message, snap.notes) == ("?c", ("?[5m",))


def test_a_complete_last_line_without_a_newline_is_read(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(HEADER + '{"t": 1}\n{"t": 2}')
    assert [s.time for s in read_trace(path).snapshots] == [1.0, 2.0]


def test_a_line_separator_inside_a_string_does_not_split_the_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(HEADER + '{"t": 1, "gpus": [{"index": 0, "name": "a\u2028b\u0085c"}]}\n', encoding="utf-8")
    assert read_trace(path).snapshots[0].gpus[0].name == "a\u2028b?c"


@pytest.mark.parametrize("times", [[5, 5, 5], [9, 3, 7], [1]])
def test_the_replay_source_plays_samples_whose_clock_stood_still_or_went_back(tmp_path: Path, times) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(HEADER + "".join(json.dumps({"t": t, "gpus": [{"index": i}]}) + "\n" for i, t in enumerate(times)))
    now = [0.0]
    source = ReplaySource(path, speed=1.0, clock=lambda: now[0])
    seen = []
    for step in range(2 * len(times)):
        now[0] = float(step)
        seen.append(source.poll().gpus[0].index)
    assert seen == list(range(len(times))) * 2
