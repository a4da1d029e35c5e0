"""`gpuopt-tui gpu` headless: --once (text, JSON, CSV), --log, replay, bad input, and no driver."""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuopt_tui.commands import gpu
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.telemetry import NoGpuSource, read_trace

SYNTHETIC = Path(__file__).parents[1] / "fixtures" / "traces" / "synthetic_3gpu.jsonl"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gpu.configure(parser)
    return parser.parse_args(list(argv))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = gpu.run(parse(*argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_once_prints_gpus_and_processes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--once", "--replay", str(SYNTHETIC))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["GPU", "NAME", "MEMORY"]
    assert "Synthetic GPU A 80GB" in lines[1] and "2.0/80.0 GiB" in lines[1] and "360/700W" in lines[1]
    assert lines[2].count("N/A") >= 5  # the card that reports little
    pid_line = next(line for line in lines if line.startswith("4242"))
    assert "20261126-101500-ig" in pid_line and "python -m gpuopt_tui.jobs" in pid_line
    assert any(line.startswith("6161") and "N/A" in line for line in lines)


def test_once_json_is_the_snapshot(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--once", "--json", "--replay", str(SYNTHETIC))
    assert code == 0
    data = json.loads(out)
    first = read_trace(SYNTHETIC).snapshots[0]
    assert data == first.to_dict()


def test_once_csv_has_a_row_per_gpu_with_na(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--once", "--csv", "--replay", str(SYNTHETIC))
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["index"] for r in rows] == ["0", "1", "2"]
    assert rows[0]["memory.used [MiB]"] == "2048" and rows[0]["power.draw [W]"] == "360.00"
    assert rows[0]["mig.mode"] == "Disabled" and rows[0]["fan.speed [%]"] == "N/A"
    assert rows[1]["temperature.gpu [C]"] == "N/A" and rows[1]["state"] == "ok"


def test_log_from_a_replay_writes_every_sample_and_appends(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "gpu.csv"
    code, _, err = run(capsys, "--log", str(log), "--replay", str(SYNTHETIC))
    assert code == 0 and "wrote 90 rows" in err
    rows = list(csv.DictReader(log.open()))
    assert len(rows) == 30 * 3
    lost = [r for r in rows if r["state"] == "lost"]
    assert {r["index"] for r in lost} == {"2"} and all(r["memory.used [MiB]"] == "N/A" for r in lost)
    code, _, _ = run(capsys, "--log", str(log), "--replay", str(SYNTHETIC), "--duration", "2")
    assert code == 0
    assert len(list(csv.DictReader(log.open()))) == 90 + 2 * 3  # appended, header written once


def test_log_refuses_to_append_to_another_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "notes.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(UserError, match="not a gpuopt-tui GPU log"):
        run(capsys, "--log", str(other), "--replay", str(SYNTHETIC))
    assert other.read_text() == "a,b\n1,2\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--once", "--interval", "0.1"], "--interval must be at least 0.25 s"),
        (["--json"], "--json and --csv go with --once"),
        (["--once", "--duration", "5"], "--duration goes with --log or --record"),
        (["--log", "x.csv", "--duration", "0"], "--duration must be positive"),
        (["--record", "x.jsonl", "--replay", str(SYNTHETIC)], "cannot be combined with --replay"),
        (["--once", "--speed", "-1"], "--speed must be positive"),
    ],
)
def test_bad_options_are_user_errors(argv: list[str], message: str) -> None:
    with pytest.raises(UserError, match=message):
        gpu.run(parse(*argv))


@pytest.mark.parametrize("argv", [["--once"], ["--log", "{dir}/g.csv"], ["--record", "{dir}/t.jsonl"]])
def test_no_driver_is_one_line_and_exit_1(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    message = "no NVIDIA driver found (libnvidia-ml.so.1 is not installed)"
    monkeypatch.setattr(gpu, "open_source", lambda *a, **k: NoGpuSource(message))
    code, out, err = run(capsys, *(a.format(dir=tmp_path) for a in argv))
    assert code == 1 and out == ""
    assert err == f"gpuopt-tui gpu: {message}\n"
    assert list(tmp_path.iterdir()) == []  # no empty log or trace left behind


def test_no_driver_with_json_is_a_json_error_and_exit_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    message = "no NVIDIA driver found (libnvidia-ml.so.1 is not installed)"
    monkeypatch.setattr(gpu, "open_source", lambda *a, **k: NoGpuSource(message))
    code, out, err = run(capsys, "--once", "--json")
    data = json.loads(out)
    assert code == 1 and err == ""
    assert data["error"] == message and data["gpus"] == [] and "message" not in data


def test_an_unreadable_trace_with_json_is_a_json_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"format": "gpuopt-tui-gpu-trace", "version": 1}\n{"t": 1, "gpus": [5]}\n')
    code, out, _ = run(capsys, "--once", "--json", "--replay", str(trace))
    assert code == 1
    assert json.loads(out) == {
        "error": f"{trace}: line 2: not a GPU sample: field 'gpus[0]': expected an object, got 5"
    }


NAN_TRACE = (
    '{"format": "gpuopt-tui-gpu-trace", "version": 1}\n'
    '{"t": 5, "gpus": [{"index": 0, "name": "\\u001b[31mred\\u001b]0;title\\u0007", "power_draw": NaN, '
    '"power_limit": Infinity}], "processes": [{"pid": 7, "gpu_index": 0, "command": "\\u001b[2Jpython"}]}\n'
)


def test_nan_in_a_trace_is_null_in_json_and_empty_in_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(NAN_TRACE)
    code, out, _ = run(capsys, "--once", "--json", "--replay", str(trace))
    assert code == 0 and "NaN" not in out and "Infinity" not in out
    data = json.loads(out)
    assert data["gpus"][0]["power_draw"] is None and data["gpus"][0]["power_limit"] is None
    code, out, _ = run(capsys, "--once", "--csv", "--replay", str(trace))
    row = next(csv.DictReader(io.StringIO(out)))
    assert code == 0 and row["power.draw [W]"] == "" and row["power.limit [W]"] == ""


@pytest.mark.parametrize("output", [[], ["--csv"], ["--json"]])
def test_escape_sequences_in_a_trace_never_reach_the_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], output: list[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(NAN_TRACE)
    code, out, err = run(capsys, "--once", "--replay", str(trace), *output)
    assert code == 0 and "\x1b" not in out + err and "\x07" not in out + err
    assert "?[31mred?]0;title?" in out  # shown, with the control characters as '?'


@pytest.mark.parametrize("option", ["--interval", "--speed", "--pcie-interval"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_numbers_are_refused(option: str, value: str) -> None:
    with pytest.raises(UserError, match=f"{option} must be a finite number"):
        gpu.run(parse("--once", option, value))


def test_the_installed_command_without_a_driver(tmp_path: Path) -> None:
    """The real process on this machine: if it has no driver, one line on stderr and exit 1, no traceback."""
    result = subprocess.run(
        [sys.executable, "-m", "gpuopt_tui", "gpu", "--once"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "GPUOPT_TUI_HOME": str(tmp_path)},
    )
    if result.returncode == 0:
        pytest.skip("this machine has an NVIDIA GPU")
    assert result.returncode == 1 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("gpuopt-tui gpu: ")


def test_ticks_keep_to_the_schedule_and_skip_missed_ones() -> None:
    now = [0.0]
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(round(seconds, 6))
        now[0] += seconds

    out = []
    for k in gpu.ticks(1.0, 6.0, clock=lambda: now[0], sleep=sleep):
        out.append((k, now[0]))
        now[0] += 2.5 if k == 1 else 0.2  # the poll at k=1 is slow
    assert out == [(0, 0.0), (1, 1.0), (4, 4.0), (5, 5.0)]
    assert sleeps == [0.8, 0.5, 0.8]
