"""Which attention kernel padded batches get (gpuopt_tui/jobs/attention.py)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from gpuopt_tui.jobs.attention import padded_batch_kernels


def sdpa_choice(q: torch.Tensor, mask: torch.Tensor | None) -> int:
    """The backend torch picks for q = k = v with this mask (an SDPBackend value)."""
    return torch._fused_sdp_choice(q, q, q, mask)


def padded_mask(device: str) -> torch.Tensor:
    mask = torch.ones(4, 16, dtype=torch.bool, device=device)
    mask[1, 10:] = False
    return mask


def test_nothing_changes_on_the_cpu() -> None:
    mask = padded_mask("cpu")
    q = torch.randn(4, 2, 16, 8)
    before = sdpa_choice(q, mask[:, None, None, :])
    with padded_batch_kernels(mask):
        assert sdpa_choice(q, mask[:, None, None, :]) == before
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask[:, None, None, :])
    assert torch.isfinite(out).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_padded_gpu_batches_get_the_memory_efficient_kernel() -> None:
    from torch.nn.attention import SDPBackend

    mask = padded_mask("cuda")
    q = torch.randn(4, 2, 16, 64, device="cuda", dtype=torch.bfloat16)
    with padded_batch_kernels(mask):
        assert sdpa_choice(q, mask[:, None, None, :]) == SDPBackend.EFFICIENT_ATTENTION
    unpadded = torch.ones_like(mask)
    default = sdpa_choice(q, None)
    with padded_batch_kernels(unpadded):
        assert sdpa_choice(q, None) == default  # no padding: torch's own choice
