"""The attention kernel for batches with padding.

On H100/H200 torch picks cuDNN's attention first. cuDNN builds an execution plan for every new input shape, and
padded batches come in many shapes: a run over length-bucketed text meets a new length with nearly every batch.
Measured on BERT-base (H200, benchmarks/results/ig_varlen_H200*.md): over 32 new lengths, IG with cuDNN ran at
a third of the rate (half with its kernel cache warm) of the memory-efficient kernel, which needs no plan and
runs the same batches as fast as cuDNN with its plans cached. Unpadded batches (fixed-length data, where the shape
repeats) keep torch's choice.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

# cuDNN is left out rather than put last: torch may reset the priority order on its first attention call.
_PADDED_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def padded_batch_kernels(mask: Tensor | None) -> contextlib.AbstractContextManager[None]:
    """Within the block, scaled_dot_product_attention does not use cuDNN's kernel when `mask` (a batch's
    attention mask) is on a GPU and has padding (the memory-efficient kernel takes such masks); otherwise nothing
    changes."""
    if mask is None or mask.device.type != "cuda" or bool(mask.all()):
        return contextlib.nullcontext()
    return varied_length_kernels(mask.device)


def varied_length_kernels(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Within the block, scaled_dot_product_attention on `device`, a GPU, does not use cuDNN's kernel: for batches
    whose length changes from one to the next (a causal LM's rows, unmasked but of many lengths)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(_PADDED_BACKENDS)
