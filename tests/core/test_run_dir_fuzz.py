"""Generated damage to run directories (meta.json, pid.json, events.jsonl, rank reports): every command answers
with exit 0 or a one-line message, never a traceback or an internal error, nothing reaches the terminal raw,
the other runs are still listed, and no process is ever signalled."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from gpuopt_tui import cli
from gpuopt_tui.core.profiles.io import profile_from_data
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.lifecycle import create_run
from gpuopt_tui.core.runs.status import this_host
from gpuopt_tui.jobs.runner import _read_reports, outcome_of_ranks

NO_PROCESS = 2**22 + 1
RUN_ID = "20250101-000000-attribution-fuzz"
FUZZ = settings(
    max_examples=20,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],  # no slow "explain" phase
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),  # NaN and infinities too
    st.text(max_size=12),  # control characters and escape sequences too
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=5,
)
pids = st.one_of(st.sampled_from([-1, 0, 1, os.getpid(), os.getppid(), NO_PROCESS]), values)


def objects(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[bytes | str | None]:
    """A file of plausible fields with one or two of any type or left out (most often); all plausible; any JSON
    value; bytes; absent (None); or a directory in its place ("dir")."""
    names = list(fields)
    valid = st.fixed_dictionaries(fields)
    changed = st.dictionaries(st.sampled_from(names), values, min_size=1, max_size=2)
    dropped = st.sets(st.sampled_from(names), max_size=2)
    damaged = st.builds(lambda d, c, x: {k: v for k, v in {**d, **c}.items() if k not in x}, valid, changed, dropped)
    weird = st.one_of(values.map(json.dumps), st.binary(max_size=40), st.sampled_from([None, "dir"]))
    return st.one_of(damaged.map(json.dumps), damaged.map(json.dumps), valid.map(json.dumps), weird).map(
        lambda x: x.encode() if isinstance(x, str) and x != "dir" else x
    )


META = objects(
    {
        "id": st.just(RUN_ID),
        "kind": st.sampled_from(["attribution", "tracin", "plan", "nope"]),
        "name": st.text(max_size=12),
        "created": st.floats(min_value=0, max_value=1e300),
        "source": st.text(max_size=12),
    }
)
PID = objects(
    {
        "pid": pids,
        "start_time": values,
        "attempt": st.integers(-2, 5),
        "host": st.sampled_from([this_host(), "elsewhere"]),
    }
)
EVENT_TYPES = st.sampled_from(
    [
        "started",
        "progress",
        "finished",
        "failed",
        "cancelled",
        "rank_started",
        "rank_finished",
        "rank_failed",
        "artifact",
        "log",
        "x",
    ]
)
EVENT = objects(
    {
        "t": st.floats(),
        "type": EVENT_TYPES,
        "rank": st.integers(-1, 3),
        "pid": pids,
        "host": st.sampled_from([this_host(), "elsewhere"]),
        "attempt": st.integers(0, 3),
        "done": st.integers(0, 10),
        "total": st.integers(0, 10),
        "rate": st.floats(),
        "eta": st.floats(),
        "gpu_reserved": values,
        "message": st.text(max_size=20),
        "summary": values,
        "stage": st.text(max_size=8),
        "path": st.text(max_size=8),
    }
)
EVENTS = st.one_of(
    st.lists(EVENT, max_size=8).map(lambda lines: b"\n".join(x for x in lines if isinstance(x, bytes)) + b"\n"),
    st.sampled_from([None, "dir"]),
)
files = st.fixed_dictionaries({"meta.json": META, "pid.json": PID, "events.jsonl": EVENTS})


class FakeProcess:
    """What a resume starts instead of a run's process: nothing."""

    pid = NO_PROCESS

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def poll(self) -> int:
        return 0

    def kill(self) -> None:
        pass


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Signals are recorded, never sent; resume starts no process."""
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr(os, "killpg", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr("gpuopt_tui.core.runs.lifecycle.subprocess.Popen", FakeProcess)
    monkeypatch.setenv("COLUMNS", "400")
    return sent


def plant(run_dir: Path, contents: dict[str, bytes | str | None]) -> None:
    for name, content in contents.items():
        path = run_dir / name
        path.unlink(missing_ok=True)
        if content == "dir":
            path.mkdir()
        elif isinstance(content, bytes):
            path.write_bytes(content)


def command(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out = capsys.readouterr()
    for text in (out.out, out.err):
        assert "internal error" not in text and "Traceback" not in text and "\x1b" not in text, text
    if code != 0:
        assert code == 1 and out.err.startswith("gpuopt-tui: error: ") and len(out.err.splitlines()) == 1, out.err
    return code, out.out, out.err


@FUZZ
@given(contents=files)
def test_commands_on_a_damaged_run_directory(
    contents: dict[str, bytes | str | None],
    guarded: list[tuple[int, int]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "runs"
        monkeypatch.setenv("GPUOPT_TUI_RUNS_DIR", str(root))
        good = create_run(profile_from_data({"kind": "attribution"}, "p.toml"), root=root)
        RunDir(good).pid.write_text(json.dumps({"pid": NO_PROCESS, "attempt": 1}))
        RunDir(good).events.write_text('{"t": 1, "type": "finished", "summary": {}}\n')
        fuzzed = root / RUN_ID
        shutil.copytree(good, fuzzed)
        plant(fuzzed, contents)

        code, out, _ = command(capsys, "runs", "--json", "--limit", "0")
        listed = {r["id"]: r for r in map(lambda line: json.loads(line, parse_constant=_no_constant), out.splitlines())}
        assert code == 0 and listed[good.name]["status"] == "finished"
        command(capsys, "runs")
        for args in (["show", RUN_ID], ["cancel", RUN_ID, "--wait", "0"], ["resume", RUN_ID, "--detach"]):
            command(capsys, *args)
        assert guarded == []


def _no_constant(name: str) -> None:
    raise AssertionError(f"`runs --json` printed {name}, which is not JSON")


@FUZZ
@given(reports=st.lists(EVENT, max_size=4), code=st.integers(-9, 2), cancelled=st.booleans())
def test_rank_reports_of_any_content_give_an_outcome(
    reports: list[bytes | str | None], code: int, cancelled: bool
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        plant(Path(tmp), {f"{rank}.json": report for rank, report in enumerate(reports)})
        kind, fields = outcome_of_ranks(_read_reports(Path(tmp)), code, cancelled)
    assert kind in ("finished", "failed", "cancelled") and isinstance(fields, dict)
