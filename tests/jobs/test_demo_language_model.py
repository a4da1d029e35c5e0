"""The demo causal language model: its data follows its rule, it learns it, its directory loads as a plain causal
LM, and Integrated Gradients on the shipped profile finds the planted animal, for the whole completion and for the
completion tokens that depend on it (checked against the rule, not against numbers of its own)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.paths import cache_dir
from gpuopt_tui.core.profiles.attribution import CompletionDataSection
from gpuopt_tui.core.profiles.common import ModelSection
from gpuopt_tui.core.profiles.io import load_profile
from gpuopt_tui.core.runs.events import EventWriter
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.jobs.attribution.job import run_job
from gpuopt_tui.jobs.context import JobContext
from gpuopt_tui.jobs.data import load_dataset
from gpuopt_tui.jobs.models import load_adapter
from gpuopt_tui.jobs.models.causal_lm import CausalLMAdapter
from gpuopt_tui.jobs.models.demo import demo_bundle, language_model
from gpuopt_tui.jobs.models.hf import load_hf_adapter
from gpuopt_tui.jobs.tracin.job import run_job as run_tracin_job

CPU = torch.device("cpu")
PROFILES = Path(__file__).resolve().parents[2] / "profiles"
PROFILE = PROFILES / "demo-attribution-lm.toml"


def planted(prompt: str) -> str:
    (animal,) = [word for word in prompt.split() if word in language_model.ANIMALS]
    return animal


def test_every_row_follows_the_rule() -> None:
    for row in language_model.make_rows(200, random.Random(3)):
        animal = planted(row["prompt"])
        assert row["completion"] == f"{language_model.ANIMALS[animal]} said the {animal}"
        assert language_model.MIN_WORDS + 1 <= len(row["prompt"].split()) <= language_model.MAX_WORDS + 1


def test_it_learns_the_rule_and_loads_as_a_plain_causal_lm(demo_causal_lm: CausalLMAdapter) -> None:
    manifest = demo_bundle("causal_lm", cache_dir()).manifest
    print(f"demo causal LM: {manifest['train_seconds']} s training, exact completions {manifest['test_accuracy']:.3f}")
    assert manifest["test_accuracy"] >= 0.9  # every completion token the model's first choice
    assert len(demo_causal_lm.checkpoints) == len(language_model.PLAN.checkpoint_epochs)
    plain = load_hf_adapter(demo_causal_lm.weights_dir, CPU)
    assert isinstance(plain, CausalLMAdapter) and plain.tokenizer.bos_token == "<s>"
    # the greedy continuation of a test prompt is its completion (and the adapters agree)
    test = demo_causal_lm.builtin_dataset("test")
    prompts = test.batch(range(8))
    generated = plain.generate(prompts, 4)
    texts = [plain.tokenizer.decode(ids.tolist()) for ids in generated["completion_ids"]]
    assert sum(t == c for t, c in zip(texts, test.meta["completions"][:8])) >= 7


def test_the_data_is_read_through_the_profile_fields(demo_causal_lm: CausalLMAdapter) -> None:
    data = CompletionDataSection(source="demo", split="test", text_field="prompt", target_field="completion")
    ds = load_dataset(data, demo_causal_lm)
    assert len(ds) == language_model.N_TEST and ds.origin == "demo causal_lm:test"
    assert all(c.endswith(planted(p)) for p, c in zip(ds.texts, ds.meta["completions"]))
    with pytest.raises(UserError, match=r'demo causal_lm:test:1: missing key "text" \(have: prompt, completion\)'):
        load_dataset(CompletionDataSection(source="demo"), demo_causal_lm)  # the default text_field


def test_load_adapter_builds_it(demo_causal_lm: CausalLMAdapter) -> None:
    adapter = load_adapter(ModelSection(adapter="demo", demo="causal_lm"), CPU, cache_dir())
    assert isinstance(adapter, CausalLMAdapter) and adapter.name == "demo causal LM"


def test_the_shipped_profile_finds_the_planted_animal(demo_causal_lm: CausalLMAdapter, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    profile = load_profile(PROFILE, ["run.device=cpu"])
    run_job(profile, JobContext(run_dir, EventWriter(RunDir(run_dir).events), cache_dir()))
    results = RunDir(run_dir).results
    records = [json.loads(line) for line in (results / "attributions.jsonl").read_text().splitlines()]
    assert len(records) == profile.attribution.n_samples
    assert all(r["within_tolerance"] for r in records)  # "auto" steps converge every row
    summary = json.loads((results / "summary.json").read_text())
    assert not summary["deltas"]["warning"] and not summary["steps"]["warning"]
    on_top = 0
    for record in records:
        animal = planted(record["text"])
        tokens = record["tokens"]

        def top(scores: list[float], tokens: list[str] = tokens) -> str:
            return tokens[max(range(len(scores)), key=lambda j: abs(scores[j]))]

        # the whole completion, and the rows of the sound (first) and of the animal named again (last)
        matrix = record["matrix"]
        on_top += top(record["scores"]) == animal and top(matrix[0]) == animal and top(matrix[-1]) == animal
    assert on_top >= 0.9 * len(records)


def test_the_shipped_tracin_profile_finds_rows_of_the_same_animal(
    demo_causal_lm: CausalLMAdapter, tmp_path: Path
) -> None:
    """Each test row's strongest proponent is a training row of the same animal (same completion), and the dataset
    ranking lists every training row once."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    profile = load_profile(PROFILES / "demo-tracin-lm.toml", ["run.device=cpu"])
    run_tracin_job(profile, JobContext(run_dir, EventWriter(RunDir(run_dir).events), cache_dir()))
    results = RunDir(run_dir).results
    rows = [json.loads(line) for line in (results / "influence.jsonl").read_text().splitlines()]
    assert len(rows) == profile.tracin.n_test
    same = sum(row["proponents"][0]["completion"] == row["completion"] for row in rows)
    assert same >= 0.9 * len(rows)
    ranked = [json.loads(line) for line in (results / "dataset_ranking.jsonl").read_text().splitlines()]
    assert sorted(r["index"] for r in ranked) == list(range(len(ranked)))
    # the rate in tokens counts each training row's prompt (with BOS) and completion
    tok = demo_causal_lm.tokenizer
    tokens = [len(tok(r["text"])["input_ids"]) + len(tok(r["completion"], add_special_tokens=False)["input_ids"])
              for r in ranked]  # fmt: skip
    timing = json.loads((results / "summary.json").read_text())["timing"]
    per_example = timing["train_tokens_per_s"] / timing["train_examples_per_s"]
    assert per_example == pytest.approx(sum(tokens) / len(tokens), rel=1e-9)
