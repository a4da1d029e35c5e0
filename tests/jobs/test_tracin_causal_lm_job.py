"""A TracIn run through the CLI on a saved tiny causal LM (Llama-shaped, random) with three checkpoints: training
and test rows as prompt + completion, results naming each test example's proponents and opponents with their text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lm_cases import save_tiny_decoder
from test_tracin_support import assert_top_proponents, save_checkpoints

from gpuopt_tui.core.profiles.common import ModelSection
from gpuopt_tui.core.profiles.io import load_profile
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.jobs.data import load_dataset
from gpuopt_tui.jobs.models import load_adapter
from gpuopt_tui.jobs.tracin import select_parameters, tracin_scores
from gpuopt_tui.jobs.tracin.checkpoints import resolve_checkpoints

TRAIN = [
    {"prompt": "the cat sat on the", "answer": "big red mat"},
    {"prompt": "a dog", "answer": "ran"},
    {"prompt": "the small blue dog ran under the", "answer": "rug"},
    {"prompt": "a happy cat", "answer": "sat on the mat"},
    {"prompt": "the red", "answer": "dog ran on the big rug"},
    {"prompt": "a sad dog sat", "answer": "under the small rug"},
]
TEST = [{"prompt": "the dog sat", "answer": "on the mat"}, {"prompt": "a small cat ran under", "answer": "the rug"}]


def jsonl(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def lm_profile(home: Path, model: Path, checkpoints: list[tuple[Path | str, float]], tracin: str) -> Path:
    """A TracIn profile on the CPU for the decoder saved at `model`, TEST as prompt/answer rows, TRAIN as the
    training set, `checkpoints` (path, lr), and the further [tracin] lines `tracin`."""
    listed = ", ".join(f'{{ path = "{path}", lr = {lr} }}' for path, lr in checkpoints)
    profile = home / "lm_tracin.toml"
    profile.write_text(
        f"""kind = "tracin"
[run]
device = "cpu"
[model]
adapter = "hf"
path = "{model}"
[data]
source = "jsonl"
path = "{jsonl(home / "test.jsonl", TEST)}"
text_field = "prompt"
target_field = "answer"
max_length = 16
[tracin]
train_path = "{jsonl(home / "train.jsonl", TRAIN)}"
checkpoints = [{listed}]
{tracin}"""
    )
    return profile


@pytest.mark.slow
def test_a_tracin_run_through_the_cli(tmp_path: Path) -> None:
    model = save_tiny_decoder("llama", tmp_path / "model")
    adapter = load_adapter(ModelSection(adapter="hf", path=str(model)), torch.device("cpu"), tmp_path / "cache")
    lrs = (0.3, 0.2, 0.1)
    checkpoints = save_checkpoints(adapter, tmp_path, lrs=lrs, scale=0.05)
    tracin = 'layers = "last"\nn_last_layers = 3\ntop_k = 2\nagreement_train = 4\n'
    profile = lm_profile(tmp_path, model, [(c.path, c.lr) for c in checkpoints], tracin)
    env = {**os.environ, "GPUOPT_TUI_RUNS_DIR": str(tmp_path / "runs"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "gpuopt_tui", "run", str(profile)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    results = RunDir(run_dir).results
    records = [json.loads(line) for line in (results / "influence.jsonl").read_text().splitlines()]
    summary = json.loads((results / "summary.json").read_text())
    assert "completion" in summary["loss"] and "prompt tokens masked" in summary["loss"]
    assert summary["completions"] == 'data.target_field = "answer"'
    agreement = summary["agreement"]  # against exact all-layer gradients (factored, unprojected)
    assert agreement["n_train"] == 4 and -1 <= agreement["spearman"] <= 1
    assert [(r["text"], r["completion"]) for r in records] == [(row["prompt"], row["answer"]) for row in TEST]
    assert all(r["completion_loss"] > 0 for r in records)
    by_text = {row["prompt"]: row["answer"] for row in TRAIN}
    for record in records:
        for side in ("proponents", "opponents"):
            assert len(record[side]) == 2
            assert all(by_text[n["text"]] == n["completion"] for n in record[side])
    ranked = [json.loads(line) for line in (results / "self_influence.jsonl").read_text().splitlines()]
    assert sorted((r["text"], r["completion"]) for r in ranked) == sorted((r["prompt"], r["answer"]) for r in TRAIN)

    # the same scores from the engine, in this process, on the profile's data and parameters
    loaded = load_profile(profile)
    train = load_dataset(loaded.data, adapter, path=loaded.tracin.train_path)
    test = load_dataset(loaded.data, adapter)
    names = select_parameters(adapter, test.batch([0]), "last", 3, ())
    assert names == summary["parameter_tensors"]
    expected = tracin_scores(adapter, resolve_checkpoints(loaded.tracin.checkpoints, adapter), train, test, names)
    assert expected.matrix is not None
    assert_top_proponents(records, expected.matrix)
