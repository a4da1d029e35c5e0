"""events.jsonl: throttled writing and tolerant incremental reading."""

from __future__ import annotations

from pathlib import Path

from gpuopt_tui.core.runs.events import EventTail, EventWriter, read_events
from gpuopt_tui.core.runs.layout import RunDir


def test_progress_is_throttled_but_forced_events_pass(tmp_path: Path) -> None:
    writer = EventWriter(RunDir(tmp_path).events)
    written = sum(writer.progress(done=i, total=1000) for i in range(1000))
    writer.progress(force=True, done=1000, total=1000)
    writer.close()
    events, corrupt = read_events(RunDir(tmp_path).events)
    assert corrupt == 0
    assert written == len(events) - 1 < 10  # a tight loop produces only a few events
    assert events[-1]["done"] == 1000


def test_tail_waits_for_half_written_line_and_skips_corrupt(tmp_path: Path) -> None:
    path = RunDir(tmp_path).events
    path.write_text('{"t": 1, "type": "started"}\nnot json at all\n{"t": 2, "type": "prog')
    tail = EventTail(path)
    assert [e["type"] for e in tail.read()] == ["started"]
    assert tail.corrupt_lines == 1
    with path.open("a") as f:
        f.write('ress", "done": 3}\n[1, 2]\n')
    assert [e["type"] for e in tail.read()] == ["progress"]
    assert tail.corrupt_lines == 2  # a JSON line that is not an event counts as corrupt too
    assert tail.read() == []


def test_tail_of_missing_file_is_empty(tmp_path: Path) -> None:
    assert EventTail(tmp_path / "nope.jsonl").read() == []
