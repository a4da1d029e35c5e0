"""The plan run kind: a closed-form plan saved as a run's results, the config left untouched."""

from __future__ import annotations

import json
from pathlib import Path

from gpuopt_tui.core.events import EventWriter, read_events
from gpuopt_tui.core.profiles.io import profile_from_data
from gpuopt_tui.jobs.context import JobContext
from gpuopt_tui.jobs.planjob import run_job

CONFIG = """\
# training config
data_loader:
  batch_size: 4   # per GPU
training:
  trainer:
    accumulate_grad_batches: 8
"""


def test_plan_run_saves_recommendation_and_diff_without_editing(tmp_path: Path, tiny_bert_dir: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    profile = profile_from_data(
        {
            "kind": "plan",
            "model": {"adapter": "hf", "path": str(tiny_bert_dir)},
            "plan": {"config": str(config), "gpu_memory_gb": 8.0, "seq_len": 64},
        },
        "plan.toml",
    )
    ctx = JobContext(tmp_path / "run", EventWriter(tmp_path / "events.jsonl"), tmp_path / "cache")
    summary = run_job(profile, ctx)
    plan = json.loads((ctx.results_dir / "plan.json").read_text())
    chosen = plan["recommendation"]["chosen"]
    assert summary["micro_batch"] == chosen["micro_batch"] > 4  # a tiny model fits far more than 4
    assert chosen["effective_batch"] == 32  # 4 x 8 is kept through accumulation
    assert chosen["utilisation"] <= 0.85
    assert sum(c["bytes"] for c in plan["current"]["components"] if c["in_peak"]) > 0
    diff = (ctx.results_dir / "config.diff").read_text()
    assert "-  batch_size: 4   # per GPU" in diff and f"+  batch_size: {chosen['micro_batch']}   # per GPU" in diff
    assert config.read_text() == CONFIG  # a run only proposes; applying is explicit
    events, _ = read_events(tmp_path / "events.jsonl")
    assert [e["type"] for e in events if e["type"] == "artifact"] == ["artifact", "artifact"]
