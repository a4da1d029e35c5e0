"""Everything the traced tier replaces in transformers and torch for a step on fake tensors, in one module:
`as_real_step` (below), `no_weight_init` (building without initialising), `skips_all_ones_masks` (which attention
builds no mask from an all-ones one) and `cuda_kernels` (CUDA's dropout memory where the fake tensors live on the
CPU). Each is undone on leaving its context.

transformers' mask code skips building an attention mask when a batch has no padding and no packed sequences, so
that attention takes its causal kernel without a mask tensor. It reads the batch to decide, and decides for a mask
whenever a tensor is fake, as it cannot read one. The traced batch of a decoder has neither padding (it gets no
attention mask) nor packed sequences (positions run 0..n-1 in every row), so a real step of it builds no mask;
`as_real_step` makes the traced step decide the same:
- `masking_utils.find_packed_sequence_indices` answers "not packed" (what reading the positions would say);
- `masking_utils.is_tracing` answers "not tracing" for a fake scalar (the query offset, which the decision never
  reads); every other tensor keeps transformers' answer, so code that would read a fake tensor still steers
  around it.
And mixture-of-experts layers: torch's fake kernel of `_grouped_mm` takes bf16 inputs only, while the layers
(fp32 master weights under autocast) pass fp32 ones; `integrations.moe._can_use_grouped_mm` answers no, so the
trace runs transformers' own fallback op (same inputs and outputs, a fake kernel of its own).
These module attributes are not public API: each is overridden only where it exists; without them the trace still
runs, counting the masks a real step would not build, or stopping at a grouped matmul with a message naming it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.nn.functional as F


@contextmanager
def _override(module: Any, name: str, replacement: Any) -> Iterator[bool]:
    original = getattr(module, name, None)
    if original is None:
        yield False
        return
    setattr(module, name, replacement(original))
    try:
        yield True
    finally:
        setattr(module, name, original)


def _scalars_not_tracing(original: Any) -> Any:
    from transformers.utils.import_utils import is_torchdynamo_compiling

    def is_tracing(tensor: Any = None) -> bool:
        if tensor is not None and getattr(tensor, "ndim", None) == 0:
            return bool(is_torchdynamo_compiling())
        return bool(original(tensor))

    return is_tracing


def _never_packed(original: Any) -> Any:
    return lambda position_ids: None


def _no_grouped_mm(original: Any) -> Any:
    return lambda *args, **kwargs: False


@contextmanager
def as_real_step() -> Iterator[list[str]]:
    """Inside it, transformers' mask code decides for the traced batch as for a real one; yields the names of the
    overrides that apply (an empty list where this transformers has none of them)."""
    try:
        from transformers import masking_utils
        from transformers.integrations import moe
    except ImportError:
        yield []
        return
    overrides = (
        (masking_utils, "is_tracing", _scalars_not_tracing),
        (masking_utils, "find_packed_sequence_indices", _never_packed),
        (moe, "_can_use_grouped_mm", _no_grouped_mm),
    )
    with ExitStack() as stack:
        yield [name for module, name, new in overrides if stack.enter_context(_override(module, name, new))]


@contextmanager
def no_weight_init() -> Iterator[None]:
    """Build models without initialising their weights (fake weights have no values, and some initialisers read
    values: truncated normals). transformers ties the embeddings in the step it skips: call the model's
    `tie_weights()` after building it."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        yield
        return
    with no_init_weights():
        yield


def skips_all_ones_masks(model: Any) -> bool:
    """Whether the model's attention is torch's SDPA, for which transformers builds no mask from an all-ones
    attention mask (eager attention always builds one). `config._attn_implementation` is where transformers keeps
    the implementation it chose; where it is missing, a model is taken to use SDPA, as the planner asks for."""
    return getattr(model.config, "_attn_implementation", "sdpa") == "sdpa"


@contextmanager
def cuda_kernels() -> Iterator[None]:
    """The memory of CUDA's dropout and attention kernels where the fake tensors live on the CPU (functions of
    `torch.nn.functional` replaced for the trace, so that recomputed layers run the same ones):
    - dropout: CUDA's fused kernel keeps a one-byte mask for backward; the CPU's keeps a mask of the input's dtype.
      `F.dropout` runs as `native_dropout` (what CUDA runs), whose mask is boolean on every device.
    - attention with dropout: CUDA's fused kernels keep the random generator's state and redraw the mask in
      backward, so dropout costs them no memory; the CPU's fall back to the unfused path, which keeps the
      sequence-by-sequence attention probabilities and their mask. Attention runs without dropout here, which
      keeps what CUDA's kernels keep.
    """
    with _override(F, "dropout", _native_dropout), _override(F, "scaled_dot_product_attention", _no_dropout):
        yield


def _native_dropout(original: Any) -> Any:
    def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if not training or p == 0.0:
            return input
        return torch.native_dropout(input, p, True)[0]

    return dropout


def _no_dropout(original: Any) -> Any:
    def attention(*args: Any, **kwargs: Any) -> torch.Tensor:
        if len(args) > 4:  # query, key, value, attn_mask, dropout_p, ...
            args = (*args[:4], 0.0, *args[5:])
        if "dropout_p" in kwargs:
            kwargs = {**kwargs, "dropout_p": 0.0}
        return original(*args, **kwargs)

    return attention
