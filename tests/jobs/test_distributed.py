"""Runs over several processes (torchrun) give the results of one process: attribution and TracIn over gloo
on the CPU (and NCCL on two GPUs where there are two), two nodes simulated on one host, a failing rank."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lm_cases import save_tiny_decoder
from safetensors.torch import load_file
from test_tracin_causal_lm_job import lm_profile
from test_tracin_lora import save_lora_checkpoints

from gpuopt_tui.core.paths import runs_dir
from gpuopt_tui.core.profiles.io import find_profile, load_profile
from gpuopt_tui.core.runs.events import TERMINAL_TYPES
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.lifecycle import start_run, wait_for
from gpuopt_tui.core.runs.status import RunInfo

pytestmark = pytest.mark.slow

ATTRIBUTION = ["attribution.n_samples=24", "attribution.n_steps=8", "attribution.batch_size=4"]
TRACIN = ["tracin.n_train=96", "tracin.n_test=6", "tracin.shard_size=32"]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch, demo_classifier: object) -> None:
    """Every process computes with one thread (torchrun's default for its workers), so that one process and
    several add up their sums in the same order."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def run(name: str | Path, overrides: list[str], timeout: float = 240) -> tuple[Path, RunInfo]:
    path = name if isinstance(name, Path) else find_profile(name)
    run_dir = start_run(load_profile(path, overrides), path)
    info = wait_for(run_dir, TERMINAL_TYPES | {"crashed"}, timeout)
    return run_dir, info


def finished(name: str | Path, overrides: list[str]) -> Path:
    run_dir, info = run(name, overrides)
    assert info.status == "finished", (info.message, RunDir(run_dir).log.read_text()[-3000:])
    return run_dir


def assert_same_attributions(one: Path, many: Path) -> None:
    a, b = (load_file(str(RunDir(d).results / "attributions.safetensors")) for d in (one, many))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-6, atol=1e-7, msg=key)
    rows = [[json.loads(line) for line in (RunDir(d).results / "attributions.jsonl").open()] for d in (one, many)]
    assert [r["tokens"] for r in rows[0]] == [r["tokens"] for r in rows[1]]


def skip_without_two_gpus(device: str) -> None:
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")


def lifecycle(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in RunDir(run_dir).events.open()]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_attribution_over_two_processes_equals_one(device: str) -> None:
    skip_without_two_gpus(device)
    one = finished("demo-attribution", [*ATTRIBUTION, f"run.device={device}"])
    many = finished("demo-attribution", [*ATTRIBUTION, f"run.device={device}", "run.devices=2"])
    assert_same_attributions(one, many)
    events = lifecycle(many)
    started = {e["rank"]: e for e in events if e["type"] == "rank_started"}
    assert sorted(started) == [0, 1]
    assert len({e["device"] for e in started.values()}) == (2 if device == "cuda" else 1)
    progress = [e for e in events if e["type"] == "progress"]
    totals = {e["rank"]: e["total"] for e in progress if e.get("stage") == "attribution"}
    assert sum(totals.values()) == 24 and all(totals.values())  # both ranks had work
    summary = json.loads((RunDir(many).results / "summary.json").read_text())
    assert summary["timing"]["processes"] == 2 and summary["timing"]["attempt_samples"] == 24


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_tracin_over_two_processes_equals_one(device: str) -> None:
    skip_without_two_gpus(device)
    one = finished("demo-tracin", [*TRACIN, f"run.device={device}"])
    many = finished("demo-tracin", [*TRACIN, f"run.device={device}", "run.devices=2"])
    a, b = (load_file(str(RunDir(d).results / "scores.safetensors")) for d in (one, many))
    assert torch.equal(a["train_index"], b["train_index"])
    torch.testing.assert_close(b["scores"], a["scores"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b["self_influence"], a["self_influence"], rtol=1e-5, atol=1e-6)
    tops = [[json.loads(line) for line in (RunDir(d).results / "influence.jsonl").open()] for d in (one, many)]
    for x, y in zip(*tops):
        assert [p["index"] for p in x["proponents"]] == [p["index"] for p in y["proponents"]]
        assert [p["index"] for p in x["opponents"]] == [p["index"] for p in y["opponents"]]
    ranked = [
        [json.loads(line)["index"] for line in (RunDir(d).results / "self_influence.jsonl").open()] for d in (one, many)
    ]
    assert ranked[0] == ranked[1]


@pytest.mark.parametrize("basis", ["random", "pca"])
def test_tracin_of_a_decoder_over_lora_checkpoints_over_two_processes_equals_one(tmp_path: Path, basis: str) -> None:
    """A causal LM's TracIn (completion loss, PEFT adapter checkpoints, factored projection along random or fitted
    directions: each rank fits its own) sharded over two processes (gloo) gives the scores of one process."""
    pytest.importorskip("peft")
    model = save_tiny_decoder("llama", tmp_path / "model")
    specs = save_lora_checkpoints("llama", tmp_path / "adapters", dtype=torch.float32)
    tracin = (
        f'method = "factored"\nprojection_in = 4\nprojection_out = 4\nshard_size = 2\nprojection_basis = "{basis}"\n'
    )
    profile = lm_profile(tmp_path, model, [(s.path, s.lr) for s in specs], tracin)
    one = finished(profile, [])
    many = finished(profile, ["run.devices=2"])
    a, b = (load_file(str(RunDir(d).results / "scores.safetensors")) for d in (one, many))
    assert torch.equal(a["train_index"], b["train_index"])
    # each rank pads its own micro-batches: fp32 sums in another order (2e-5 relative seen)
    torch.testing.assert_close(b["scores"], a["scores"], rtol=1e-4, atol=1e-5)
    started = {e["rank"] for e in lifecycle(many) if e["type"] == "rank_started"}
    assert started == {0, 1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_simulated_on_one_host_equal_one_process() -> None:
    """The multi-node recipe: `gpuopt-tui run` with nodes = 2 on the first node, `gpuopt-tui join RUN` on the
    second; here both are CPU processes of this host meeting at a c10d rendezvous on localhost."""
    one = finished("demo-attribution", ATTRIBUTION)
    overrides = [*ATTRIBUTION, "run.device=cpu", "run.nodes=2", f"run.rendezvous=127.0.0.1:{_free_port()}"]
    path = find_profile("demo-attribution")
    run_dir = start_run(load_profile(path, overrides), path)
    printed = subprocess.run(
        [sys.executable, "-m", "gpuopt_tui", "join", str(run_dir), "--print"], capture_output=True, text=True
    )
    assert "--rdzv-backend c10d" in printed.stdout and run_dir.name in printed.stdout
    joined = subprocess.run(
        [sys.executable, "-m", "gpuopt_tui", "join", run_dir.name], capture_output=True, text=True, timeout=240
    )
    info = wait_for(run_dir, TERMINAL_TYPES | {"crashed"}, 60)
    assert joined.returncode == 0, joined.stdout[-2000:] + joined.stderr[-2000:]
    assert info.status == "finished", (info.message, RunDir(run_dir).log.read_text()[-3000:])
    assert_same_attributions(one, run_dir)
    assert sorted(e["rank"] for e in lifecycle(run_dir) if e["type"] == "rank_started") == [0, 1]


FAILING_PLUGIN = """
import os
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.models.demo import load_demo_adapter


def make(device, cache_dir):
    if os.environ.get("RANK") == "1":
        raise UserError("this rank's data shard is unreadable")
    return load_demo_adapter("classifier", device, cache_dir)
"""


def test_one_rank_failing_fails_the_run_with_its_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "rank_plugin.py").write_text(FAILING_PLUGIN)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{Path(__file__).resolve().parents[2]}")
    overrides = [*ATTRIBUTION, "run.device=cpu", "run.devices=2", "model.adapter=plugin"]
    run_dir, info = run("demo-attribution", [*overrides, "model.factory=rank_plugin:make"])
    assert info.status == "failed"
    assert info.message.startswith("rank 1 on ") and "this rank's data shard is unreadable" in info.message
    assert run_dir.parent == runs_dir()
