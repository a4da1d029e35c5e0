"""Attention for sequences of up to 128 tokens: one fused kernel per pass, forward and backward.

Classifier inputs are short (128 tokens in the benchmarks). At that length the general attention kernels spend
more time on bookkeeping than on arithmetic: in one IG chunk of BERT-base on H100 (bf16, seq 128,
benchmarks/results/ig_variants_H100_knobs.md) cuDNN's backward took 25 ms in three kernels (the backward proper,
a dot(dO, O) pre-pass and a conversion of dQ accumulated in fp32). Here one program holds a whole (sequence,
head): its [seq, seq] scores fit on chip, so the backward is one kernel that reads Q, K, V and dO once, writes
dQ, dK and dV once, and needs neither atomics nor the forward's output. Padding is a key mask; any length up to
128 runs the same few compiled kernels (the block is the next power of two), so variable-length batches build
no per-shape plan. Measured at one IG chunk's shapes (benchmarks/results/attention_H200.md): the backward in
1.13 ms against about 1.85 ms for cuDNN's; with padding, forward and backward 2.21 ms against 3.07 ms for the
memory-efficient kernel.

`short_attention` takes [batch, seq, heads, dim] as the model's projections give them (no transposes) and
returns the same layout. `supports` says when it applies (a CUDA GPU of compute capability 8.0 or later,
fp16/bf16, seq <= 128, dim a power of two 16..128, triton installed, not switched off, not inside a torch.func
transform); elsewhere callers keep `scaled_dot_product_attention`. Both passes are torch custom ops, so torch.compile
keeps them as they are; torch.func's vmap and grad cannot run them (their autograd rule is not a functorch one), so
within those transforms `short_attention` computes the same attention with `scaled_dot_product_attention`.
GPUOPT_TUI_SHORT_ATTENTION=0 in the environment switches these kernels off for the process; `switched_off()`
does so within a block. Triton compiles them on a machine's first use and keeps them in its disk cache.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

#: The longest sequence one program holds.
MAX_SEQ = 128
_DTYPES = (torch.float16, torch.bfloat16)
_LOG2E = math.log2(math.e)
_switched_on = os.environ.get("GPUOPT_TUI_SHORT_ATTENTION", "1") != "0"


@functools.cache
def _kernels() -> Any | None:
    try:
        from gpuopt_tui.jobs import short_attention_kernels
    except ImportError:  # no triton: callers keep torch's attention
        return None
    return short_attention_kernels


@contextlib.contextmanager
def switched_off() -> Iterator[None]:
    """Within the block `supports` says no: callers keep torch's attention (for comparisons)."""
    global _switched_on
    before, _switched_on = _switched_on, False
    try:
        yield
    finally:
        _switched_on = before


@functools.cache
def _capable(device: torch.device) -> bool:
    """A GPU with bf16 tensor cores (Ampere and later), and triton to build the kernels."""
    return device.type == "cuda" and torch.cuda.get_device_properties(device).major >= 8 and _kernels() is not None


def applies_to(device: torch.device, dtype: torch.dtype | None) -> bool:
    """Whether these kernels run for this device and dtype (given a short enough sequence). Asked at every
    attention call of the lean forward, so the device's answer is kept."""
    return _switched_on and dtype in _DTYPES and _capable(device) and not _in_functorch_transform()


def _in_functorch_transform() -> bool:
    """Whether the caller runs inside torch.func's vmap, grad, jvp, ... (per-example TracIn gradients)."""
    return torch._C._functorch.maybe_current_level() is not None


def supports(query: Tensor, key_mask: Tensor | None = None) -> bool:
    """Whether `short_attention` runs for this [batch, seq, heads, dim] query (and [batch, seq] bool mask)."""
    _, seq, _, dim = query.shape
    return (
        0 < seq <= MAX_SEQ
        and dim in (16, 32, 64, 128)
        and (key_mask is None or key_mask.dtype == torch.bool)
        and applies_to(query.device, query.dtype)
    )


def short_attention(query: Tensor, key: Tensor, value: Tensor, key_mask: Tensor | None = None) -> Tensor:
    """softmax(q k^T / sqrt(dim) over the kept keys) v for [batch, seq, heads, dim] tensors of one length;
    `key_mask` [batch, seq] is True where a key may be attended to. Differentiable in q, k and v."""
    if _in_functorch_transform():
        mask = None if key_mask is None else key_mask[:, None, None, :]
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    out, _ = _forward(query, key, value, key_mask)
    return out


def block_size(seq: int) -> int:
    """The rows one program holds for a length: the next power of two, at least 16."""
    return max(16, 1 << (seq - 1).bit_length())


def _keep(key_mask: Tensor | None, placeholder: Tensor) -> Tensor:
    """The key mask as bytes for the kernels; without a mask, any tensor (HAS_MASK=False never reads it)."""
    return placeholder if key_mask is None else key_mask.contiguous().view(torch.uint8)


def forward_config(seq: int) -> dict[str, int]:
    """Launch settings of the forward kernel for a length (benchmarks/attention_bench.py --sweep measures them)."""
    return {"num_warps": 4 if seq <= 64 else 8}


def backward_config(seq: int) -> dict[str, int]:
    """Launch settings of the backward kernel: warps, and query rows a step (BLOCK_M)."""
    return {"num_warps": 4, "BLOCK_M": min(block_size(seq), 64)}


def run_forward(
    query: Tensor, key: Tensor, value: Tensor, key_mask: Tensor | None, **config: int
) -> tuple[Tensor, Tensor]:
    """The forward kernel: the output [batch, seq, heads, dim] and the log-sum-exp (base 2) [batch, heads, seq]."""
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    batch, seq, heads, dim = query.shape
    out = query.new_empty(query.shape)
    lse = torch.empty((batch, heads, seq), device=query.device, dtype=torch.float32)
    _kernels().attention_forward[(batch * heads,)](
        query, key, value, out, lse, _keep(key_mask, lse), heads, seq, _LOG2E / math.sqrt(dim),
        HAS_MASK=key_mask is not None, BLOCK=block_size(seq), DIM=dim, **(config or forward_config(seq)),
    )  # fmt: skip
    return out, lse


def run_backward(
    grad: Tensor, query: Tensor, key: Tensor, value: Tensor, lse: Tensor, key_mask: Tensor | None, **config: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward kernel: the gradients to the query, key and value."""
    grad, query, key, value = grad.contiguous(), query.contiguous(), key.contiguous(), value.contiguous()
    batch, seq, heads, dim = query.shape
    grads = [query.new_empty(query.shape) for _ in range(3)]
    scale = 1.0 / math.sqrt(dim)
    _kernels().attention_backward[(batch * heads,)](
        query, key, value, grad, lse, *grads, _keep(key_mask, lse), heads, seq, scale, scale * _LOG2E,
        HAS_MASK=key_mask is not None, BLOCK=block_size(seq), DIM=dim, **(config or backward_config(seq)),
    )  # fmt: skip
    return grads[0], grads[1], grads[2]


@torch.library.custom_op("gpuopt_tui::short_attention", mutates_args=())
def _forward(query: Tensor, key: Tensor, value: Tensor, key_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    return run_forward(query, key, value, key_mask)


@_forward.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, key_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    batch, seq, heads, _ = query.shape
    return query.new_empty(query.shape), query.new_empty((batch, heads, seq), dtype=torch.float32)


@torch.library.custom_op("gpuopt_tui::short_attention_backward", mutates_args=())
def _backward(
    grad: Tensor, query: Tensor, key: Tensor, value: Tensor, lse: Tensor, key_mask: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    return run_backward(grad, query, key, value, lse, key_mask)


@_backward.register_fake
def _(
    grad: Tensor, query: Tensor, key: Tensor, value: Tensor, lse: Tensor, key_mask: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    return query.new_empty(query.shape), query.new_empty(query.shape), query.new_empty(query.shape)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    query, key, value, key_mask = inputs
    ctx.save_for_backward(query, key, value, output[1], key_mask)


def _differentiate(ctx: Any, grad_out: Tensor, _grad_lse: Tensor | None) -> tuple[Tensor | None, ...]:
    query, key, value, lse, key_mask = ctx.saved_tensors
    return (*_backward(grad_out, query, key, value, lse, key_mask), None)


_forward.register_autograd(_differentiate, setup_context=_setup_context)
