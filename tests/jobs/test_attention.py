"""Which attention kernel padded batches get (gpuopt_tui/jobs/attention.py)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from gpuopt_tui.jobs.attention import padded_batch_kernels


def padded_mask(device: str) -> torch.Tensor:
    mask = torch.ones(4, 16, dtype=torch.bool, device=device)
    mask[1, 10:] = False
    return mask


def attention_ops(q: torch.Tensor, mask: torch.Tensor | None) -> set[str]:
    """The aten attention ops one scaled_dot_product_attention call dispatches to."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    return {e.key for e in prof.key_averages() if e.key.startswith("aten::_") and "attention" in e.key}


def test_nothing_changes_on_the_cpu() -> None:
    mask = padded_mask("cpu")
    q = torch.randn(4, 2, 16, 8)
    before = attention_ops(q, mask[:, None, None, :])
    assert before  # the profiler sees the op
    with padded_batch_kernels(mask):
        assert attention_ops(q, mask[:, None, None, :]) == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_padded_gpu_batches_get_the_memory_efficient_kernel() -> None:
    mask = padded_mask("cuda")
    q = torch.randn(4, 2, 16, 64, device="cuda", dtype=torch.bfloat16)
    with padded_batch_kernels(mask):
        assert "aten::_scaled_dot_product_efficient_attention" in attention_ops(q, mask[:, None, None, :])
    default = attention_ops(q, None)
    with padded_batch_kernels(torch.ones_like(mask)):
        assert attention_ops(q, None) == default  # no padding: torch's own choice
