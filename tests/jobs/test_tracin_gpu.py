"""TracIn on a CUDA GPU: fp32 scores against the float64 CPU reference, bf16/fp16 forwards against fp32 on a
trained model, and the automatic micro-batch (a memory probe, then the rest of a block at once). Skipped
without CUDA."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from test_tracin_support import bert_adapter, max_rel_error, naive_tracin, save_checkpoints, text_dataset, trained_bert
from torch import Tensor

from gpuopt_tui.jobs.models.base import to_device
from gpuopt_tui.jobs.tracin import (
    GradientComputer,
    Reporter,
    TracInOptions,
    rank_correlation,
    select_parameters,
    tracin_scores,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
CUDA = torch.device("cuda")


@pytest.mark.parametrize("method", ["closed_form", "vmap"])
def test_fp32_on_the_gpu_matches_the_float64_reference(tmp_path: Path, method: str) -> None:
    cpu = bert_adapter(torch.float64)
    checkpoints = save_checkpoints(cpu, tmp_path)
    train, test = text_dataset(cpu, 24, seed=1), text_dataset(cpu, 4, seed=2)
    names = select_parameters(cpu, test.batch([0]), "last", 2)
    reference, reference_self = naive_tracin(cpu, checkpoints, train, test, names)
    gpu = bert_adapter(torch.float32, device=CUDA)
    result = tracin_scores(gpu, checkpoints, train, test, names, TracInOptions(method=method))
    assert max_rel_error(result.matrix, reference) < 1e-4
    assert max_rel_error(result.self_influence, reference_self) < 1e-4


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_agrees_with_fp32_on_a_trained_model(tmp_path: Path, precision: str) -> None:
    adapter, checkpoints, train, test = trained_bert(tmp_path, CUDA)
    names = select_parameters(adapter, to_device(test.batch([0]), CUDA), "last", 2)
    fp32 = tracin_scores(adapter, checkpoints, train, test, names)
    low = tracin_scores(adapter, checkpoints, train, test, names, TracInOptions(precision=precision))
    error = float((low.matrix - fp32.matrix).double().norm() / fp32.matrix.double().norm())
    rho = rank_correlation(low.matrix, fp32.matrix)
    self_error = float(((low.self_influence - fp32.self_influence).abs() / fp32.self_influence).median())
    figures = f"relative error {error:.2e}, Spearman {rho:.5f}, self-influence error {self_error:.2e}"
    assert 0 < error < 5e-2 and rho > 0.98 and self_error < 5e-2, figures


class Events(Reporter):
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def event(self, type: str, **fields: Any) -> None:
        self.events.append((type, fields))


def test_auto_micro_batch_probes_on_the_test_examples_then_takes_whole_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = bert_adapter(torch.float32, device=CUDA)
    checkpoints = save_checkpoints(adapter, tmp_path)
    train, test = text_dataset(adapter, 1000, seed=3), text_dataset(adapter, 5, seed=4)
    names = select_parameters(adapter, to_device(test.batch([0]), CUDA), "last", 2)
    calls: list[int] = []
    original = GradientComputer.features

    def spy(self: GradientComputer, batch: dict[str, Tensor]) -> Any:
        calls.append(len(batch["labels"]))
        return original(self, batch)

    monkeypatch.setattr(GradientComputer, "features", spy)
    reporter = Events()
    result = tracin_scores(adapter, checkpoints, train, test, names, reporter=reporter)
    probes = [fields for kind, fields in reporter.events if kind == "batch_probe"]
    assert len(probes) == 1 and probes[0]["examples"] == len(test)  # the test examples are the probe
    # checkpoint 1: the probe, then every training row at once; later checkpoints: the training rows first, the
    # test examples' forward queued behind them
    assert calls == [len(test), len(train)] + [len(train), len(test)] * (len(checkpoints) - 1)
    assert result.stats["final_batch_size"] == len(train)


#: (layers, options): every way the engine computes gradients.
MODES = [
    ("last", TracInOptions(method="closed_form")),
    ("last", TracInOptions(method="vmap")),
    ("all", TracInOptions(method="vmap")),
    ("all", TracInOptions(method="vmap", projection_dim=256)),
    ("all", TracInOptions(method="factored")),
    ("all", TracInOptions(method="factored", projection_in=16, projection_out=16)),
]


@pytest.mark.parametrize(("layers", "mode"), MODES)
def test_every_mode_runs_in_bf16_with_the_lean_forward(tmp_path: Path, layers: str, mode: TracInOptions) -> None:
    """bf16 is where the lean forward's fused attention kernels apply (torch.func's vmap cannot run them)."""
    adapter, checkpoints, train, test = trained_bert(tmp_path, CUDA)
    names = select_parameters(adapter, to_device(test.batch([0]), CUDA), layers, 2)
    options = dataclasses.replace(mode, batch_size=8)
    method = options.method
    fp32 = tracin_scores(adapter, checkpoints, train, test, names, options)
    bf16 = tracin_scores(adapter, checkpoints, train, test, names, dataclasses.replace(options, precision="bf16"))
    assert bf16.stats["method"] == method and bool(bf16.matrix.isfinite().all())
    assert rank_correlation(bf16.matrix, fp32.matrix) > 0.95
