"""Runs driven through the real CLI on the demo model: finish, cancel, resume, fail."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_stages import hf_load_stages, stages

from gpuopt_tui.core.runs.events import read_events
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.startup import FIRST_BATCH, LAUNCH_STAGE, PYTHON_STAGE, startup_stages
from gpuopt_tui.core.runs.status import RunWatcher

pytestmark = pytest.mark.slow


def cli(*args: str, runs: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPUOPT_TUI_RUNS_DIR": str(runs), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "gpuopt_tui", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def lifecycle(run_dir: Path) -> list[str]:
    lines = RunDir(run_dir).events.read_text().splitlines()
    return [e["type"] for e in map(json.loads, lines) if e["type"] != "progress"]


def test_run_in_foreground_finishes_with_results(tmp_path: Path, demo_classifier: object) -> None:
    result = cli("run", "demo-attribution", "--set", "n_samples=8", "--set", "n_steps=8", runs=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "finished" in result.stderr
    (run_dir,) = tmp_path.iterdir()
    assert lifecycle(run_dir)[0] == "started" and lifecycle(run_dir)[-1] == "finished"
    rows = (RunDir(run_dir).results / "attributions.jsonl").read_text().splitlines()
    assert len(rows) == 8
    assert stages(run_dir / "events.jsonl") == [  # the demo is cached: no build stage
        "importing torch",
        "importing the engine",
        "loading the model",
        *hf_load_stages(),
        "loading the demo's test data",
        "preparing the engine",
        "attribution [samples]",
        "collecting the batches [batches]",
        "audit: strict fp32 reference [samples]",
        "writing results",
        "attribution [samples]",
    ]


def test_a_run_reports_its_start_up_stage_by_stage(tmp_path: Path, demo_classifier: object) -> None:
    """From the command's launch to the first computed batch: every stage once, in order, as a chain (each ends
    where the next begins), the last ending with the first batch; `show` and the run's own output name them."""
    result = cli("run", "demo-attribution", "--set", "n_samples=8", "--set", "n_steps=8", runs=tmp_path)
    assert result.returncode == 0, result.stderr
    (run_dir,) = tmp_path.iterdir()
    events, _ = read_events(RunDir(run_dir).events)
    types = [e["type"] for e in events]
    assert types.index("started") < types.index("startup")
    profile = startup_stages(events)
    names = [s.name for s in profile]
    assert names == [
        LAUNCH_STAGE,
        PYTHON_STAGE,
        "importing torch",
        "importing the engine",
        "loading the model",
        *hf_load_stages(),
        "loading the demo's test data",
        "preparing the engine",
        f"attribution ({FIRST_BATCH})",
    ]
    assert all(s.seconds >= 0 for s in profile)
    ends = [s.at for s in profile]
    assert ends == sorted(ends) and all(s.first_batch == (s is profile[-1]) for s in profile)
    for before, stage in itertools.pairwise(profile):
        assert stage.at - stage.seconds == pytest.approx(before.at, abs=2e-3)  # a chain: no gaps, no overlaps
    assert profile[0].at - profile[0].seconds == pytest.approx(0.0, abs=2e-3)  # from the launch
    written = [e for e in events if e["type"] == "startup"]
    assert len(written) == len(profile) and written[-1].get("first_batch") is True  # nothing after the first batch
    assert f"start-up: {profile[-1].at:.2f} s from the launch {FIRST_BATCH}" in " ".join(result.stderr.split())
    assert "the demo model runs on one CPU thread" in RunDir(run_dir).log.read_text()
    assert "labels, on cpu (1 thread);" in RunDir(run_dir).log.read_text()
    shown = cli("show", run_dir.name, runs=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert all(name in shown.stdout for name in names if len(name) < 60)


def test_cancel_then_resume_completes_every_sample(tmp_path: Path, demo_classifier: object) -> None:
    # the one-step-at-a-time reference path is slow enough to be cancelled part-way on any machine
    overrides = [
        "--set",
        "n_samples=24",
        "--set",
        "n_steps=96",
        "--set",
        "batch_size=4",
        "--set",
        "use_optimized=false",
    ]
    started = cli("run", "demo-attribution", *overrides, "--detach", runs=tmp_path)
    assert started.returncode == 0, started.stderr
    run_id = started.stdout.strip()
    run_dir = tmp_path / run_id
    watcher = RunWatcher(tmp_path)
    deadline = time.monotonic() + 120
    while (watcher.info(run_dir).progress.get("done") or 0) < 4:
        assert time.monotonic() < deadline, RunDir(run_dir).log.read_text()
        time.sleep(0.2)
    cancelled = cli("cancel", run_id, runs=tmp_path)
    assert cancelled.returncode == 0, cancelled.stderr
    info = watcher.info(run_dir)
    assert info.status == "cancelled"
    kept = [p.name for p in RunDir(run_dir).state.iterdir() if p.name.startswith("batch")]
    assert kept, "finished batches are kept as shards"
    resumed = cli("resume", run_id, runs=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.count("demo classifier:") == 1, resumed.stderr  # the new attempt's setup line only
    events = [e for e in lifecycle(run_dir) if e in ("started", "cancelled", "finished")]
    assert events == ["started", "cancelled", "started", "finished"]
    rows = [json.loads(x) for x in (RunDir(run_dir).results / "attributions.jsonl").read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == sorted({r["index"] for r in rows}) and len(rows) == 24


def test_failing_run_reports_message_and_log(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text('{"body": "no text field here", "label": 1}\n')
    profile = tmp_path / "p.toml"
    profile.write_text(f'kind = "attribution"\n[data]\nsource = "jsonl"\npath = "{data}"\n')
    result = cli("run", str(profile), runs=tmp_path / "runs")
    assert result.returncode == 1
    assert "failed" in result.stderr and "text" in result.stderr
    assert "last lines of log.txt" in result.stderr
    assert "Traceback" not in result.stderr
