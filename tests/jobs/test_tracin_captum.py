"""TracIn scores against Captum's TracInCP on the same layers (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from captum.influence import TracInCP
from test_tracin_support import bert_adapter, max_rel_error, save_checkpoints, text_dataset
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from gpuopt_tui.jobs.models.base import Adapter
from gpuopt_tui.jobs.tracin import TracInOptions, select_parameters, tracin_scores

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Logits(nn.Module):
    """model(input_ids, attention_mask) -> logits, the calling convention Captum expects."""

    def __init__(self, adapter: Adapter) -> None:
        super().__init__()
        self.adapter = adapter
        self.inner = adapter.model

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.adapter.logits({"input_ids": input_ids, "attention_mask": attention_mask})


@pytest.mark.parametrize("sample_wise", [False, True])
def test_matches_captum_tracincp_on_the_last_layers(tmp_path: Path, sample_wise: bool) -> None:
    adapter = bert_adapter(torch.float32)
    checkpoints = save_checkpoints(adapter, tmp_path)
    train, test = text_dataset(adapter, 12, seed=5), text_dataset(adapter, 4, seed=6)
    names = select_parameters(adapter, test.batch([0]), "last", 2)
    modules = sorted({n.rsplit(".", 1)[0] for n in names})
    lrs = {str(c.path): c.lr for c in checkpoints}

    def load(model: nn.Module, path: str) -> float:
        adapter.load_weights(Path(path))
        return lrs[path]

    captum = TracInCP(
        Logits(adapter),
        TensorDataset(*(train.tensors[k] for k in ("input_ids", "attention_mask", "labels"))),
        list(lrs),
        checkpoints_load_func=load,
        layers=[f"inner.{m}" for m in modules],
        loss_fn=nn.CrossEntropyLoss(reduction="sum" if sample_wise else "none"),
        batch_size=5,
        sample_wise_grads_per_batch=sample_wise,
    )
    expected = captum.influence(tuple(test.tensors[k] for k in ("input_ids", "attention_mask", "labels")))
    expected_self = captum.self_influence()
    ours = tracin_scores(adapter, checkpoints, train, test, names, TracInOptions(batch_size=5))
    assert ours.matrix is not None and ours.matrix.dtype == torch.float32
    assert max_rel_error(ours.matrix, expected) < 1e-4
    assert max_rel_error(ours.self_influence, expected_self) < 1e-4
