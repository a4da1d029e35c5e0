"""The plan run kind: a closed-form or measured plan saved as a run's results (with the share of the budget its
search kept back), readable later, and the config left untouched."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from run_stages import stages

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.planner import session
from gpuopt_tui.core.planner.fit import ProbeResult
from gpuopt_tui.core.planner.measure import MeasuredPlan, measure, probe_request
from gpuopt_tui.core.planner.search import CLOSED_FORM_HEADROOM
from gpuopt_tui.core.profiles.io import profile_from_data
from gpuopt_tui.core.results.plan import read_saved_plan
from gpuopt_tui.core.runs.events import EventWriter, read_events
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.jobs import planjob
from gpuopt_tui.jobs.context import JobContext

GIB = 1024**3
MIB = 1024**2

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
    ctx = JobContext(tmp_path / "run", EventWriter(RunDir(tmp_path).events), tmp_path / "cache")
    summary = planjob.run_job(profile, ctx)
    plan = json.loads((ctx.results_dir / "plan.json").read_text())
    chosen = plan["recommendation"]["chosen"]
    assert summary["micro_batch"] == chosen["micro_batch"] > 4  # a tiny model fits far more than 4
    assert chosen["effective_batch"] == 32  # 4 x 8 is kept through accumulation
    assert chosen["utilisation"] <= 0.85
    rec = plan["recommendation"]
    assert rec["tier"] == "closed-form estimate" and rec["headroom"] == CLOSED_FORM_HEADROOM == 0.05
    assert summary["headroom"] == 0.05
    assert max(c["peak"] for c in rec["candidates"]) <= rec["budget_bytes"] * 0.95  # planned for 95% of it
    assert read_saved_plan(tmp_path / "run").recommendation.headroom == 0.05
    assert sum(c["bytes"] for c in plan["current"]["components"] if c["in_peak"]) > 0
    diff = (ctx.results_dir / "config.diff").read_text()
    assert "-  batch_size: 4   # per GPU" in diff and f"+  batch_size: {chosen['micro_batch']}   # per GPU" in diff
    assert config.read_text() == CONFIG  # a run only proposes; applying is explicit
    events, _ = read_events(RunDir(tmp_path).events)
    assert [e["type"] for e in events if e["type"] == "artifact"] == ["artifact", "artifact"]
    assert stages(tmp_path / "events.jsonl") == [
        "reading the model and training configs",
        "estimate [steps]",
        "recommend [steps]",
        "done [steps]",
    ]


def _closed_form_plan(tmp_path: Path, tiny_bert_dir: Path) -> tuple[Path, Path, dict[str, Any]]:
    """A closed-form plan run of the tiny BERT for an 8 GB card: its run folder, its plan.json and what it holds."""
    profile = profile_from_data(
        {"kind": "plan", "model": {"adapter": "hf", "path": str(tiny_bert_dir)}, "plan": {"gpu_memory_gb": 8.0}},
        "plan.toml",
    )
    run = tmp_path / "run"
    planjob.run_job(profile, JobContext(run, EventWriter(RunDir(tmp_path).events), tmp_path / "cache"))
    path = RunDir(run).results / "plan.json"
    return run, path, json.loads(path.read_text())


def test_saved_plans_without_headroom_still_load(tmp_path: Path, tiny_bert_dir: Path) -> None:
    """plan.json from before the closed form kept headroom (its search kept none back) reads as 0; a value that is
    not a share of the budget is refused as a plan this version cannot read."""
    run, path, data = _closed_form_plan(tmp_path, tiny_bert_dir)
    del data["recommendation"]["headroom"]
    path.write_text(json.dumps(data))
    saved = read_saved_plan(run)
    assert saved.recommendation.headroom == 0.0 and saved.recommendation.tier == "closed-form estimate"
    assert saved.probes is None
    data["recommendation"]["headroom"] = 1.5
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"plan.json: not a plan this version can read .*headroom 1.5"):
        read_saved_plan(run)


def test_a_next_divisor_inside_the_kept_back_share_is_saved(tmp_path: Path, tiny_bert_dir: Path) -> None:
    """A saved plan keeps the recommendation's `within_reserve` candidate (none in this one: nothing fits only
    inside the share kept back)."""
    run, path, data = _closed_form_plan(tmp_path, tiny_bert_dir)
    assert (
        data["recommendation"]["within_reserve"] is None and read_saved_plan(run).recommendation.within_reserve is None
    )
    budget = data["recommendation"]["budget_bytes"]
    nxt = {**data["recommendation"]["chosen"], "label": "next divisor", "micro_batch": 32, "accumulate": 2}
    data["recommendation"]["within_reserve"] = {**nxt, "peak": int(0.99 * budget)}
    path.write_text(json.dumps(data))
    rec = read_saved_plan(run).recommendation
    assert rec.within_reserve is not None and rec.within_reserve.micro_batch == 32
    assert rec.within_reserve.peak == int(0.99 * budget) and rec.within_reserve.accumulate == 2


def test_measured_plan_saves_the_gpu_probes_and_fit(
    tmp_path: Path, tiny_bert_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probes come from a simulated GPU whose peak reserved memory is 1 GiB + 40 MiB per sequence."""

    def simulated(request: Mapping[str, Any]) -> ProbeResult:
        b = int(request["micro_batch"])
        reserved = GIB + b * 40 * MIB
        if reserved + 500 * MIB > 8 * GIB:
            return ProbeResult(b, b, oom=True)
        return ProbeResult(b, b, max_reserved=reserved, max_allocated=reserved // 2, context=500 * MIB, drift=b * MIB)

    def measure_here(inputs: session.PlanInputs, log: Callable[[str], None]) -> MeasuredPlan:
        request = lambda b: probe_request(inputs.model.config, inputs.spec.task, inputs.setup.with_batch(b))  # noqa: E731
        return measure(request, 1, inputs.budget, 16, probe=simulated, log=log)

    monkeypatch.setattr(planjob, "measure_probes", measure_here)
    profile = profile_from_data(
        {
            "kind": "plan",
            "run": {"device": "cuda:1"},
            "model": {"adapter": "hf", "path": str(tiny_bert_dir)},
            "plan": {"gpu_memory_gb": 8.0, "seq_len": 64, "measure": True},
        },
        "plan.toml",
    )
    ctx = JobContext(tmp_path / "run", EventWriter(RunDir(tmp_path).events), tmp_path / "cache")
    planjob.run_job(profile, ctx)
    plan = json.loads((ctx.results_dir / "plan.json").read_text())
    assert plan["gpu_index"] == 1 and plan["gpu_label"] == "8 GB given"
    measured = plan["measured"]
    probes = measured["probes"]
    assert len(probes) >= 2 and all(p["peak_reserved"] == GIB + p["micro_batch"] * 40 * MIB for p in probes)
    assert all(p["peak_allocated"] == p["peak_reserved"] // 2 and p["alloc_retries"] == 0 for p in probes)
    assert measured["fit"]["slope_per_sequence"] == pytest.approx(40 * MIB)
    assert measured["fit"]["intercept"] == pytest.approx(GIB)
    assert measured["context"] == 500 * MIB
    assert plan["recommendation"]["tier"] == "measured"
    assert measured["confirmed_micro_batch"] <= measured["largest_micro_batch"]
    saved = read_saved_plan(tmp_path / "run")
    # the headroom kept back is the largest drift a probe measured, as a share of the budget
    drift = max(p["drift"] for p in probes)
    assert drift == max(p["micro_batch"] for p in probes) * MIB
    headroom = drift / int(0.85 * 8 * GIB)
    assert saved.recommendation.tier == "measured" and saved.recommendation.headroom == pytest.approx(headroom)
    assert plan["recommendation"]["headroom"] == pytest.approx(headroom)
    assert saved.probes is not None and saved.probes.confirmed == measured["confirmed_micro_batch"]
    assert [(r.micro_batch, r.oom, r.max_reserved) for r in saved.probes.results] == [
        (p["micro_batch"], p["oom"], p["peak_reserved"]) for p in probes
    ]
    assert "measuring on the GPU [steps]" in stages(tmp_path / "events.jsonl")


def test_a_plan_run_of_a_family_the_closed_form_refuses_traces_it(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    model = tmp_path / "phi"
    model.mkdir()
    phi = {
        "model_type": "phi",
        "architectures": ["PhiForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
    }
    (model / "config.json").write_text(json.dumps(phi))
    profile = profile_from_data(
        {"kind": "plan", "model": {"adapter": "hf", "path": str(model)}, "plan": {"gpu_memory_gb": 2.0, "seq_len": 64}},
        "plan.toml",
    )
    ctx = JobContext(tmp_path / "run", EventWriter(RunDir(tmp_path).events), tmp_path / "cache")
    summary = planjob.run_job(profile, ctx)
    plan = json.loads((ctx.results_dir / "plan.json").read_text())
    assert plan["current"]["tier"] == "traced on fake tensors (no GPU)"
    assert plan["recommendation"]["tier"] == summary["tier"] == "traced"
    assert read_saved_plan(tmp_path / "run").recommendation.tier == "traced"
    assert stages(tmp_path / "events.jsonl")[1:3] == ["estimate [steps]", "searching by traces on fake tensors [steps]"]
