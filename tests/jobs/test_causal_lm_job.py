"""Attribution runs on a saved tiny causal LM (Llama-shaped, random): prompts with completions from the data, the
model's own greedy continuations, per completion token, and a run through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lm_cases import save_tiny_decoder
from safetensors.torch import load_file

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.io import profile_from_data
from gpuopt_tui.core.runs.events import EventWriter, read_events
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.jobs.attribution.job import run_job
from gpuopt_tui.jobs.context import JobContext
from gpuopt_tui.jobs.models import load_adapter
from gpuopt_tui.jobs.models.causal_lm import CausalLMAdapter

ROWS = [
    {"prompt": "the cat sat on the", "completion": "big red mat"},
    {"prompt": "a dog", "completion": "ran"},
    {"prompt": "the quick blue river and the sun", "completion": "sleeps under the hill"},
    {"prompt": "snow and rain", "completion": "not good"},
    {"prompt": "the moon", "completion": "very happy"},
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lm_job")
    save_tiny_decoder("llama", root / "model")
    (root / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": row["prompt"]}) + "\n" for row in ROWS))
    return root


def profile_data(workdir: Path, data_file: str = "data.jsonl", **attribution: Any) -> dict[str, Any]:
    settings = {"n_steps": 8, "method": "gausslegendre", "batch_size": 2, "audit_samples": 1, **attribution}
    return {
        "kind": "attribution",
        "run": {"device": "cpu"},
        "model": {"adapter": "hf", "path": str(workdir / "model")},
        "data": {"source": "jsonl", "path": str(workdir / data_file), "text_field": "prompt", "max_length": 16},
        "attribution": settings,
    }


def run(workdir: Path, name: str, **attribution: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    run_dir = workdir / "runs" / name
    run_dir.mkdir(parents=True)
    ctx = JobContext(run_dir, EventWriter(RunDir(run_dir).events), run_dir / "cache")
    data = profile_data(workdir, **attribution)
    run_job(profile_from_data(data, "test.toml"), ctx)
    results = RunDir(run_dir).results
    records = [json.loads(line) for line in (results / "attributions.jsonl").read_text().splitlines()]
    return records, json.loads((results / "summary.json").read_text())


@pytest.fixture(scope="module")
def adapter(workdir: Path) -> CausalLMAdapter:
    profile = profile_from_data(profile_data(workdir), "test.toml")
    loaded = load_adapter(profile.model, torch.device("cpu"), workdir / "cache")
    assert isinstance(loaded, CausalLMAdapter)  # recognised from config.json's architectures
    return loaded


def test_records_hold_the_prompt_heatmap_and_the_completion(workdir: Path, adapter: CausalLMAdapter) -> None:
    records, summary = run(workdir, "whole", n_steps="auto", tolerance=1e-3)
    assert [r["text"] for r in records] == [row["prompt"] for row in ROWS]
    batch = adapter.tokenize([row["prompt"] for row in ROWS], 16) | adapter.completions(
        [row["completion"] for row in ROWS], 16
    )
    logprobs = adapter.logits(batch)[:, 0].detach()
    for i, record in enumerate(records):
        real = batch["attention_mask"][i].bool()
        assert record["tokens"] == adapter.tokens(batch["input_ids"][i][real].tolist())
        assert len(record["scores"]) == len(record["tokens"]) and record["scores"][0] == 0.0  # BOS kept
        assert record["completion"] == ROWS[i]["completion"]
        assert record["completion_tokens"] == ROWS[i]["completion"].split()
        assert record["logprob"] == pytest.approx(float(logprobs[i]), rel=1e-5)
        assert record["probability"] == pytest.approx(float(logprobs[i].exp()), rel=1e-5)
        assert not record["generated"] and "matrix" not in record
        assert record["top"] and record["top"][0][1] in record["tokens"]
    assert summary["completions"]["source"] == 'data.target_field = "completion"'
    assert summary["n_samples"] == len(ROWS)
    assert summary["audit"]["above"] == 0 and all(r["within_tolerance"] for r in records)


def test_per_target_token_gives_a_completion_by_prompt_matrix(workdir: Path) -> None:
    whole, _ = run(workdir, "whole-again")
    records, summary = run(workdir, "per-token", per_target_token=True)
    assert summary["completions"]["per_target_token"] and summary["n_samples"] == len(ROWS)
    events, _ = read_events(RunDir(workdir / "runs" / "per-token").events)
    progress = [e for e in events if e["type"] == "progress" and e.get("stage") == "attribution"]
    tokens = sum(len(r["completion_tokens"]) for r in records)  # the rows counted are (sample, token) rows
    assert progress[-1]["unit"] == "completion tokens" and progress[-1]["done"] == progress[-1]["total"] == tokens
    for record, plain in zip(records, whole):
        matrix = torch.tensor(record["matrix"])
        assert matrix.shape == (len(record["completion_tokens"]), len(record["tokens"]))
        # IG is linear in the explained output: the rows add up to the whole completion's scores
        assert torch.allclose(matrix.sum(0), torch.tensor(plain["scores"]), rtol=1e-4, atol=1e-6)
        assert sum(record["token_logprobs"]) == pytest.approx(record["logprob"], rel=1e-5)
        assert record["scores"] == pytest.approx(matrix.sum(0).tolist(), rel=1e-5, abs=1e-6)
        # each row's delta, and the sample's delta the sum of its rows'
        assert len(record["token_deltas"]) == len(record["token_relative_deltas"]) == len(matrix)
        assert sum(record["token_deltas"]) == pytest.approx(record["delta"], rel=1e-4, abs=1e-7)
        # each row's top prompt tokens: its largest |scores| in order, BOS (structure) left out
        for row, top in zip(record["matrix"], record["token_top"]):
            ranked = sorted(range(1, len(row)), key=lambda j: -abs(row[j]))[: len(top)]
            assert [item[0] for item in top] == ranked
            assert [item[1:] for item in top] == [[record["tokens"][j], row[j]] for j in ranked]


def fp32(values: Any) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_the_tensors_file_holds_the_completions_and_the_matrix(workdir: Path, adapter: CausalLMAdapter) -> None:
    records, _ = run(workdir, "per-token-tensors", per_target_token=True)
    tensors = load_file(str(RunDir(workdir / "runs" / "per-token-tensors").results / "attributions.safetensors"))
    lengths = tensors["completion_lengths"].tolist()
    assert lengths == [len(r["completion_tokens"]) for r in records]
    width = max(lengths)
    assert tensors["matrix"].shape == (len(records), width, tensors["scores"].shape[1])
    for i, record in enumerate(records):
        prompt, length = int(tensors["lengths"][i]), lengths[i]
        matrix = tensors["matrix"][i]
        # the JSON floats read back as the same fp32 values
        assert torch.equal(matrix[:length, :prompt], fp32(record["matrix"]))
        assert not matrix[length:].any() and not matrix[:, prompt:].any()  # zero padding
        for key in ("token_logprobs", "token_deltas", "token_relative_deltas"):
            assert torch.equal(tensors[key][i, :length], fp32(record[key])) and not tensors[key][i, length:].any()
        assert torch.equal(tensors["logprob"][i], fp32(record["logprob"]))
        ids = tensors["completion_ids"][i]
        assert adapter.tokens(ids[:length].tolist()) == record["completion_tokens"] and not ids[length:].any()


def test_the_tensors_file_of_a_whole_completion_run_has_no_matrix(workdir: Path) -> None:
    records, _ = run(workdir, "whole-tensors")
    tensors = load_file(str(RunDir(workdir / "runs" / "whole-tensors").results / "attributions.safetensors"))
    assert "matrix" not in tensors and "token_logprobs" not in tensors
    assert tensors["completion_lengths"].tolist() == [len(r["completion_tokens"]) for r in records]
    assert torch.equal(tensors["logprob"], fp32([r["logprob"] for r in records]))


def test_generated_completions_are_recorded(workdir: Path) -> None:
    records, summary = run(workdir, "generated", data_file="prompts.jsonl", target="generate", max_new_tokens=3)
    assert summary["completions"]["source"].startswith("generated")
    for record in records:
        assert record["generated"] and 1 <= len(record["completion_tokens"]) <= 3
        assert record["completion"].split() == [t for t in record["completion_tokens"] if t != "</s>"]


def test_a_causal_lm_without_completions_is_told_what_to_set(workdir: Path) -> None:
    with pytest.raises(UserError, match='no completions.*target = "generate"'):
        run(workdir, "no-completions", data_file="prompts.jsonl")


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("per_target_token", True, "per_target_token = true needs a causal"),
        ("target", "generate", "generate.* needs a"),
    ],
)
def test_a_classifier_refuses_the_causal_lm_settings(
    workdir: Path, tiny_bert_dir: Path, key: str, value: Any, message: str
) -> None:
    data = profile_data(workdir, data_file="prompts.jsonl", **{key: value})
    data["model"]["path"] = str(tiny_bert_dir)
    run_dir = workdir / "runs" / f"classifier-{key}"
    run_dir.mkdir(parents=True)
    ctx = JobContext(run_dir, EventWriter(RunDir(run_dir).events), run_dir / "cache")
    with pytest.raises(UserError, match=message):
        run_job(profile_from_data(data, "test.toml"), ctx)


@pytest.mark.slow
def test_a_run_through_the_cli(workdir: Path, tmp_path: Path) -> None:
    data = profile_data(workdir, n_steps="auto", tolerance=1e-3)
    lines = ['kind = "attribution"']
    for name in ("run", "model", "data", "attribution"):
        lines.append(f"[{name}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in data[name].items()]
    (tmp_path / "lm.toml").write_text("\n".join(lines) + "\n")
    env = {**os.environ, "GPUOPT_TUI_RUNS_DIR": str(tmp_path / "runs"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "gpuopt_tui", "run", str(tmp_path / "lm.toml")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    records = [json.loads(line) for line in (RunDir(run_dir).results / "attributions.jsonl").read_text().splitlines()]
    assert [r["text"] for r in records] == [row["prompt"] for row in ROWS]
    assert all(len(r["scores"]) == len(r["tokens"]) and r["within_tolerance"] for r in records)
    assert "causal LM" in (RunDir(run_dir).path / "log.txt").read_text() + result.stderr
