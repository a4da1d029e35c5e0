"""Mixed precision on a trained model: a bf16 forward moves TracIn scores by rounding-sized amounts only, and
the rank agreement used to report it behaves as a rank correlation should."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from test_tracin_support import trained_bert

from gpuopt_tui.jobs.tracin import TracInOptions, rank_correlation, select_parameters, tracin_scores

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.parametrize(
    ("layers", "options", "min_spearman"),
    [
        ("last", TracInOptions(), 0.995),
        # projected in bf16 too; many of this model's scores are nearly tied, so rounding swaps some ranks
        ("all", TracInOptions(method="factored", projection_in=8, projection_out=8), 0.99),
    ],
    ids=["last-closed-form", "all-factored"],
)
def test_bf16_forward_agrees_with_fp32_on_a_trained_model(
    tmp_path: Path, layers: str, options: TracInOptions, min_spearman: float
) -> None:
    adapter, checkpoints, train, test = trained_bert(tmp_path)
    names = select_parameters(adapter, test.batch([0]), layers, 2)
    fp32 = tracin_scores(adapter, checkpoints, train, test, names, options)
    bf16 = tracin_scores(adapter, checkpoints, train, test, names, dataclasses.replace(options, precision="bf16"))
    assert fp32.matrix is not None and bf16.matrix is not None
    assert bf16.matrix.dtype == torch.float32  # scores accumulate in fp32 whatever the forward's precision
    difference = (bf16.matrix - fp32.matrix).double()
    assert float(difference.norm() / fp32.matrix.double().norm()) < 1e-2
    assert float(difference.abs().max()) > 0  # the forward did run in bf16
    assert rank_correlation(bf16.matrix, fp32.matrix) > min_spearman
    self_error = (bf16.self_influence - fp32.self_influence).abs() / fp32.self_influence
    assert float(self_error.median()) < 1e-2


def test_rank_correlation() -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 50, generator=gen)
    assert rank_correlation(a, a) == pytest.approx(1.0)
    assert rank_correlation(a, -a) == pytest.approx(-1.0)
    assert rank_correlation(a, a.exp()) == pytest.approx(1.0)  # ranks only: any increasing map agrees fully
    assert abs(rank_correlation(a, torch.randn(3, 50, generator=gen))) < 0.3
    with pytest.raises(ValueError, match="differ in shape"):
        rank_correlation(a, a[:, :10])
