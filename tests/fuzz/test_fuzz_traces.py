"""GPU traces, damaged at random, fed to `gpuopt-tui gpu --once --replay` (text, --json, --csv): a sample or
a message naming the file, never a traceback, a raw escape or invalid JSON; the trace is never written."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.telemetry import ReplaySource, read_trace

from .inputs import FUZZ, JSON_VALUES, check_result, damaged, json_output, run_cli, unchanged

SYNTHETIC = Path(__file__).parents[1] / "fixtures" / "traces" / "synthetic_3gpu.jsonl"
GOOD = b"".join(SYNTHETIC.read_bytes().splitlines(keepends=True)[:3])  # the header and two samples
OUTPUTS = st.sampled_from([[], ["--json"], ["--csv"]])


def check_once(path: Path, output: list[str]) -> None:
    def once() -> None:
        result = run_cli("gpu", "--once", "--replay", str(path), *output)
        if output == ["--json"]:
            data = json_output(result)
            assert result.code == 0 or path.name in data["error"]
        check_result(result, path)

    unchanged(path, once)


def check_replay(path: Path) -> None:
    """A trace that reads also replays: every poll, over a loop, gives a sample."""
    try:
        trace = read_trace(path)
    except UserError:
        return
    source = ReplaySource(trace, speed=None)
    for _ in range(len(trace.snapshots) + 2):
        source.poll()


@FUZZ
@given(content=damaged(GOOD), output=OUTPUTS)
def test_damaged_traces(scratch: Path, content: bytes, output: list[str]) -> None:
    path = scratch / "trace.jsonl"
    path.write_bytes(content)
    check_once(path, output)
    check_replay(path)


def _fields(sample: dict) -> list[tuple[object, object]]:
    """(container, key) of every value in a sample, nested ones included."""
    found: list[tuple[object, object]] = []
    for key, value in sample.items():
        found.append((sample, key))
        for item in value if isinstance(value, list) else ():
            if isinstance(item, dict):
                found += [(item, k) for k in item]
    return found


@FUZZ
@given(data=st.data(), output=OUTPUTS)
def test_traces_with_a_field_of_any_type(scratch: Path, data: st.DataObject, output: list[str]) -> None:
    header, *samples = GOOD.decode().splitlines()
    sample = json.loads(samples[0])
    for _ in range(data.draw(st.integers(1, 3))):
        container, key = data.draw(st.sampled_from(_fields(sample)))
        container[key] = data.draw(JSON_VALUES)  # type: ignore[index]
    path = scratch / "typed.jsonl"
    path.write_text("\n".join([header, json.dumps(sample), samples[1]]) + "\n")
    check_once(path, output)
    check_replay(path)
