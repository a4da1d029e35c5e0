"""`gpuopt-tui plan` end to end on the CPU: show, search, apply with confirmation, undo, and clear errors; on a
machine with the GPU planned for (a stand-in GPU whose probes follow a line) the search is the measured one."""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from model_configs import BERT_BASE

from gpuopt_tui.cli import main
from gpuopt_tui.core.planner import gpu, session
from gpuopt_tui.core.planner.fit import ProbeResult
from gpuopt_tui.core.planner.measure import measure

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "yaml"
GIB = 1024**3
MIB = 1024**2


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


def one_line(text: str) -> str:
    """The output with the console's line wrapping undone."""
    return " ".join(text.split())


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
    assert "candidates (closed-form estimate)" in out and "measuring" not in out
    assert "closed-form estimate; 5% of the budget kept back for its error: planned for 19.4 GiB of 20.4 GiB" in (
        one_line(out)
    )
    code, out, err = plan(capsys, *common, "--apply")  # stdin is not a terminal: no silent writes
    assert code == 1 and "pass --yes" in err and config.read_bytes() == original
    code, out, err = plan(capsys, *common, "--apply", "--yes")
    assert code == 0, err
    assert "-  batch_size: 4 " in out and "+  batch_size: 64 " in out
    assert "-    accumulate_grad_batches: 16 " in out and "+    accumulate_grad_batches: 1 " in out
    written = config.read_text()
    assert "batch_size: 64       # micro-batch per GPU" in written
    assert config.with_name("config.yaml.backup.1").read_bytes() == original
    code, out, err = plan(capsys, *common, "--apply", "--yes")
    assert code == 0 and "already holds the recommended values" in out
    code, out, err = plan(capsys, "--config", str(config), "--undo", "--yes")
    assert code == 0, err
    assert config.read_bytes() == original
    code, out, err = plan(capsys, "--config", str(config), "--undo", "--yes")
    assert code == 1 and "nothing to undo" in err


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


def test_on_the_gpu_planned_for_auto_and_apply_measure(
    work: tuple[Path, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 24 GiB stand-in GPU whose probes peak at 1 GiB + 24 MiB per sequence, with 400 MiB of context: under
    85% of it a micro-batch of b x 25 sequences (16+8 samples per anchor) fits up to b = 32, so the effective
    batch of 64 is 32 x 2 measured, where the closed form (--gpu-memory 24, no probes) finds 64 x 1."""
    model, config = work
    total = 24 * GIB

    def probe(request: Mapping[str, Any]) -> ProbeResult:
        b = int(request["micro_batch"])
        sequences = b * (1 + int(request["n_positives"]) + int(request["n_negatives"]))
        reserved, context = GIB + sequences * 24 * MIB, 400 * MIB
        if reserved + context > total:
            return ProbeResult(b, sequences, oom=True, gpu_total=total)
        return ProbeResult(b, sequences, max_reserved=reserved, context=context, gpu_total=total)

    monkeypatch.setattr(gpu, "detect", lambda index=0, binding=None: gpu.GpuMemory(total, "Stand-in (GPU 0, NVML)"))
    monkeypatch.setattr(session, "measure", partial(measure, probe=probe))
    common = ["--config", str(config), "--model", str(model), "--trainable", "lora"]
    code, out, err = plan(capsys, *common, "--auto")
    assert code == 0, err
    text = one_line(out)
    assert "measuring on Stand-in (GPU 0, NVML)" in text
    assert "probe b=32: peak reserved" in text and "confirmed micro-batch 32:" in text
    assert "candidates (measured)" in text
    assert "> recommended (exact): micro-batch 32 x accumulate 2 = 64" in text
    # the stand-in's probes do not drift from step to step: the headroom comes from the drift, so none is kept
    assert "measured: nothing kept back, the whole 20.4 GiB budget planned for" in text
    assert "kept back for its error" not in text
    code, out, err = plan(capsys, *common, "--apply", "--yes")
    assert code == 0, err
    assert "+  batch_size: 32 " in out and "+    accumulate_grad_batches: 2 " in out
    assert "batch_size: 32       # micro-batch per GPU" in config.read_text()

    code, out, err = plan(capsys, *common, "--gpu-memory", "24", "--auto")  # a card named: no probes
    assert code == 0, err
    assert "probe" not in out and "> recommended (exact): micro-batch 64 x accumulate 1" in one_line(out)
    assert "closed-form estimate; 5% of the budget kept back" in one_line(out)
