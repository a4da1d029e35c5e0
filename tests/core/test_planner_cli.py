"""`gpuopt-tui plan` end to end on the CPU: show, search, apply with confirmation, undo, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gpuopt_tui.cli import main
from gpuopt_tui.core.planner import gpu

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "yaml"
BERT_BASE = {
    "model_type": "bert",
    "architectures": ["BertModel"],
    "vocab_size": 30522,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "max_position_embeddings": 512,
}


@pytest.fixture
def work(tmp_path: Path) -> tuple[Path, Path]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(BERT_BASE))
    config = tmp_path / "config.yaml"
    shutil.copy(CORPUS / "lightning.yaml", config)
    return model, config


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_show_prints_the_breakdown(work: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    model, config = work
    code, out, err = plan(capsys, "--config", str(config), "--model", str(model), "--gpu-memory", "24", "--show")
    assert code == 0, err
    assert "16+8 samples per anchor" in out and "checkpointing on" in out
    for row in ("Weights", "Optimizer state (adamw)", "Activations (checkpointed)", "CUDA context", "total on the GPU"):
        assert row in out
    assert "of the GPU, within the 85% budget" in out
    assert "candidates" not in out


def test_auto_apply_and_undo(work: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    model, config = work
    original = config.read_bytes()
    common = ["--config", str(config), "--model", str(model), "--gpu-memory", "24", "--trainable", "lora"]
    code, out, err = plan(capsys, *common, "--auto")
    assert code == 0, err
    assert "> recommended (exact)" in out and config.read_bytes() == original
    code, out, err = plan(capsys, *common, "--apply")  # stdin is not a terminal: no silent writes
    assert code == 1 and "pass --yes" in err and config.read_bytes() == original
    code, out, err = plan(capsys, *common, "--apply", "--yes")
    assert code == 0, err
    assert "-  batch_size: 4 " in out and "+  batch_size: 64 " in out
    assert "-    accumulate_grad_batches: 16 " in out and "+    accumulate_grad_batches: 1 " in out
    written = config.read_text()
    assert "batch_size: 64       # micro-batch per GPU" in written
    assert config.with_name("config.yaml.backup").read_bytes() == original
    code, out, err = plan(capsys, *common, "--apply", "--yes")
    assert code == 0 and "already holds the recommended values" in out
    code, out, err = plan(capsys, "--config", str(config), "--undo", "--yes")
    assert code == 0, err
    assert config.read_bytes() == original
    code, out, err = plan(capsys, "--config", str(config), "--undo", "--yes")
    assert code == 1 and "no .backup files" in err


def test_without_a_gpu_the_message_says_what_to_do(
    work: tuple[Path, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, config = work
    monkeypatch.setattr(gpu, "detect", lambda index=0, binding=None: None)
    code, _, err = plan(capsys, "--config", str(config), "--model", str(model))
    assert code == 1
    assert "no GPU 0 found through NVML" in err and "--gpu-memory GB" in err and "Traceback" not in err
    code, _, err = plan(capsys, "--config", str(config), "--model", str(model), "--gpu-memory", "24", "--profile")
    assert code == 1 and "No GPU 0 found here through NVML: measuring needs a GPU" in err


def test_bad_inputs_are_one_line_errors(work: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    model, config = work
    code, _, err = plan(capsys, "--config", str(CORPUS / "malformed.yaml"), "--model", str(model), "--gpu-memory", "8")
    assert code == 1 and "malformed.yaml: not valid YAML at line" in err
    code, _, err = plan(capsys, "--model", str(config.parent / "nowhere"), "--gpu-memory", "8")
    assert code == 1 and "nowhere: no such file (expected a model directory with config.json" in err
    code, _, err = plan(capsys, "--config", str(config), "--model", str(model), "--gpu-memory", "8", "--key", "bs=x")
    assert code == 1 and 'unknown role "bs"' in err
