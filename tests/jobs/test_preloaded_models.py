"""Weights a warm runner read ahead (jobs/models/preloaded.py): a run on that directory gets them, once, and says
so; a directory whose files changed since, or another class, is read again; the loaders go through it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from lm_cases import save_tiny_decoder
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from gpuopt_tui.core.profiles.common import ModelSection
from gpuopt_tui.jobs.models import load_adapter
from gpuopt_tui.jobs.models.preloaded import preload, read_model


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return save_tiny_decoder("llama", tmp_path / "model")


def test_the_run_gets_the_weights_read_ahead_once(model_dir: Path) -> None:
    said: list[str] = []
    preload(model_dir)
    first = read_model(model_dir, AutoModelForCausalLM, log=said.append)
    assert said and "the weights the warm runner read before the run" in said[0]
    second = read_model(model_dir, AutoModelForCausalLM, log=said.append)  # given once: read again
    assert second is not first and len(said) == 1
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)


def test_changed_files_or_another_class_are_read_again(model_dir: Path) -> None:
    said: list[str] = []
    preload(model_dir)
    weights = next(model_dir.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000))
    read_model(model_dir, AutoModelForCausalLM, log=said.append)
    assert said == []
    preload(model_dir)
    other = read_model(model_dir, AutoModelForSequenceClassification, log=said.append)  # not what was read ahead
    assert said == [] and type(other).__name__ == "LlamaForSequenceClassification"


def test_the_causal_lm_loader_takes_the_weights_read_ahead(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    preload(model_dir)
    adapter = load_adapter(ModelSection(adapter="hf", path=str(model_dir)), torch.device("cpu"), model_dir.parent)
    assert "the weights the warm runner read before the run" in capsys.readouterr().out
    assert adapter.model.training is False
