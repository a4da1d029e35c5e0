"""A TracIn run through the CLI on a saved tiny causal LM (Llama-shaped, random) with three LoRA adapter checkpoints
written by peft: the adapter's parameters count by default and the summary says so; the dataset-level ranking's
mean and max influence are those of the run's own score matrix; `gpuopt-tui select` prints and exports the top slice
by either."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lm_cases import save_tiny_decoder
from safetensors.torch import load_file
from test_tracin_causal_lm_job import TEST, TRAIN, lm_profile
from test_tracin_lora import save_lora_checkpoints

from gpuopt_tui.core.runs.layout import RunDir

pytest.importorskip("peft")
pytestmark = pytest.mark.slow


def cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPUOPT_TUI_RUNS_DIR": str(home / "runs"), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-m", "gpuopt_tui", *args], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("lora-run")
    model = save_tiny_decoder("llama", home / "model")
    specs = save_lora_checkpoints("llama", home / "adapters", dtype=torch.float32)
    tracin = "top_k = 2\nagreement_train = 4\n"
    profile = lm_profile(home, model, [(s.path, s.lr) for s in specs], tracin)
    done = cli(home, "run", str(profile))
    (home / "run-output.txt").write_text(done.stdout + done.stderr)
    return home


def run_dir(home: Path) -> Path:
    (found,) = (home / "runs").iterdir()
    return found


def test_the_adapter_parameters_count_and_the_summary_says_why(lora_run: Path) -> None:
    results = RunDir(run_dir(lora_run)).results
    summary = json.loads((results / "summary.json").read_text())
    assert summary["checkpoint_kind"] == "PEFT adapter"
    assert summary["checkpoints"][0]["path"].endswith("step0/adapter_model.safetensors")
    assert summary["parameter_choice"]["layers"] == "adapter"
    assert "tracin.layers = auto" in summary["parameter_choice"]["source"]
    tensors = summary["parameter_tensors"]
    assert tensors and all(".lora_A." in n or ".lora_B." in n for n in tensors)
    assert "PEFT adapter" in summary["agreement"]["reference"]
    said = f"parameters that count: adapter ({len(tensors)} tensors; tracin.layers = auto, as the checkpoints are PEFT"
    assert said in (run_dir(lora_run) / "log.txt").read_text()
    assert said in " ".join((lora_run / "run-output.txt").read_text().split())  # what `gpuopt-tui run` printed


def test_the_dataset_ranking_holds_each_examples_mean_and_max_over_the_queries(lora_run: Path) -> None:
    results = RunDir(run_dir(lora_run)).results
    saved = load_file(str(results / "scores.safetensors"))
    matrix, rows = saved["scores"].double().tolist(), saved["train_index"].tolist()
    mean = {r: sum(m[j] for m in matrix) / len(matrix) for j, r in enumerate(rows)}
    best = {r: max(m[j] for m in matrix) for j, r in enumerate(rows)}
    ranked = [json.loads(line) for line in (results / "dataset_ranking.jsonl").read_text().splitlines()]
    assert [r["index"] for r in ranked] == sorted(rows, key=lambda r: -mean[r])
    assert [r["rank"] for r in ranked] == list(range(1, len(TRAIN) + 1))
    for r in ranked:
        assert r["mean_influence"] == pytest.approx(mean[r["index"]], rel=1e-5)
        assert r["max_influence"] == pytest.approx(best[r["index"]], rel=1e-5)
        assert r["n_queries"] == len(TEST)
        assert (r["text"], r["completion"]) == (TRAIN[r["index"]]["prompt"], TRAIN[r["index"]]["answer"])
    with (results / "dataset_ranking.csv").open(newline="") as f:
        assert [int(row["index"]) for row in csv.DictReader(f)] == [r["index"] for r in ranked]


def test_select_prints_and_exports_the_top_slice(lora_run: Path, tmp_path: Path) -> None:
    results = RunDir(run_dir(lora_run)).results
    ranked = [json.loads(line) for line in (results / "dataset_ranking.jsonl").read_text().splitlines()]
    by_max = sorted(ranked, key=lambda r: -r["max_influence"])
    out = tmp_path / "top.csv"
    shown = cli(lora_run, "select", run_dir(lora_run).name, "--percent", "50", "--by", "max", "--out", str(out))
    n = math.ceil(len(TRAIN) * 0.5)
    assert f"top 50% of {len(TRAIN)} training examples by max influence over the test set: {n}" in shown.stdout
    with out.open(newline="") as f:
        exported = list(csv.DictReader(f))
    assert [int(row["index"]) for row in exported] == [r["index"] for r in by_max[:n]]
    assert [row["completion"] for row in exported] == [r["completion"] for r in by_max[:n]]
    printed = cli(lora_run, "select", run_dir(lora_run).name, "--top", "2").stdout
    assert "top 2 of 6 training examples by mean influence" in printed
    lines = printed.splitlines()
    for r in ranked[:2]:
        assert any(str(r["index"]) in line and r["text"] in line and r["completion"] in line for line in lines)
    assert not any(ranked[2]["text"] in line for line in lines)
