"""On the demo classifier (trained on the spot), self-influence ranks the deliberately flipped labels first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuopt_tui.core.profiles.io import load_profile
from gpuopt_tui.core.runs.events import EventWriter
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.jobs.context import JobContext
from gpuopt_tui.jobs.tracin.job import run_job

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "demo-tracin.toml"


@pytest.mark.slow
def test_self_influence_finds_the_flipped_labels(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    profile = load_profile(PROFILE, ["run.device=cpu"])
    summary = run_job(profile, JobContext(run_dir, EventWriter(RunDir(run_dir).events), tmp_path / "cache"))
    assert summary["flipped_label_auc"] >= 0.9
    ranked = [json.loads(line) for line in (RunDir(run_dir).results / "self_influence.jsonl").read_text().splitlines()]
    n_flipped = sum(entry["flipped"] for entry in ranked)
    assert n_flipped > 0
    top = ranked[:n_flipped]
    assert sum(entry["flipped"] for entry in top) >= 0.5 * n_flipped
