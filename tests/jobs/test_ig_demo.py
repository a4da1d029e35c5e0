"""On the demo classifier (trained on the spot), Integrated Gradients finds the planted opinion words."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from gpuopt_tui.core.profiles.io import load_profile
from gpuopt_tui.core.runs.events import EventWriter
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.jobs.attribution.job import run_job
from gpuopt_tui.jobs.context import JobContext
from gpuopt_tui.jobs.models.demo.classifier import NEGATIVE, POSITIVE

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "demo-attribution.toml"


@pytest.mark.slow
def test_planted_tokens_rank_on_top(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    profile = load_profile(PROFILE, ["run.device=cpu"])
    run_job(profile, JobContext(run_dir, EventWriter(RunDir(run_dir).events), tmp_path / "cache"))
    signal = {*POSITIVE, *NEGATIVE}
    records = [json.loads(line) for line in (RunDir(run_dir).results / "attributions.jsonl").read_text().splitlines()]
    assert len(records) == profile.attribution.n_samples

    # Per sample: the largest attribution sits on one of the two planted words.
    top_is_signal = [r["top"][0][1] in signal for r in records]
    assert sum(top_is_signal) >= 0.9 * len(records)

    # Overall: the planted words seen often enough to be ranked come before every filler word.
    counts = Counter(token for r in records for token in r["tokens"])
    ranked = {t for t in signal if counts[t] >= profile.attribution.min_token_count}
    assert len(ranked) >= 4
    ranking = json.loads((RunDir(run_dir).results / "summary.json").read_text())["top_k"]
    assert {entry["token"] for entry in ranking[: len(ranked)]} == ranked
