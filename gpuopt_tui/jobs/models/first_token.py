"""Run the last encoder layer for the first token only when the logits read nothing else.

A BERT-style classifier (BERT, RoBERTa, ELECTRA, ...) feeds its head with the final hidden state of the first
token alone. In the last encoder layer every other position still needs its keys and values (the first token
attends to them), but its query, attention output, feed-forward block and layer norms only matter for the first
token: computing them for one position instead of all is exact and skips about 5/6 of that layer's work, in the
forward and the backward pass alike (~7% of a 12-layer model, ~20% of a 4-layer one).

`first_token_only(model)` swaps that forward in while logits are computed (IG steps, TracIn gradients) and puts
the layer's own forward back afterwards; parameter names and values are untouched, so functional calls and
hooks keep working. A model qualifies only if its structure matches and a check on random tokens gives the
same logits as the full forward; otherwise the context does nothing.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: How close the pruned logits must be to the full ones (fp32, relative to their largest magnitude).
CHECK_TOLERANCE = 1e-4
#: Heads known to read the first token only (class name of the model -> its base model attribute).
FIRST_TOKEN_HEADS = {
    "BertForSequenceClassification": "bert",
    "RobertaForSequenceClassification": "roberta",
    "XLMRobertaForSequenceClassification": "roberta",
    "ElectraForSequenceClassification": "electra",
    "CamembertForSequenceClassification": "roberta",
}
_ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")

# model -> the bound first-token forward to install (one object per model, so a compiled graph guarding on
# the layer's forward sees the same object every time), or None when the model does not qualify.
_verdicts: weakref.WeakKeyDictionary[nn.Module, tuple[nn.Module, Callable[..., Any]] | None] = (
    weakref.WeakKeyDictionary()
)


@contextlib.contextmanager
def first_token_only(model: nn.Module) -> Iterator[bool]:
    """Within the block, the model's last encoder layer computes the first token only (if the model qualifies,
    see the module docstring); yields whether it does. Only logits may be read meanwhile, not hidden states."""
    if model not in _verdicts:
        _verdicts[model] = _qualify(model)
    verdict = _verdicts[model]
    if verdict is None or "forward" in vars(verdict[0]):  # not applicable, or already inside such a block
        yield verdict is not None
        return
    layer, forward = verdict
    layer.forward = forward
    try:
        yield True
    finally:
        del layer.forward


def _last_layer(model: nn.Module) -> nn.Module | None:
    base_name = FIRST_TOKEN_HEADS.get(type(model).__name__)
    config = getattr(model, "config", None)
    if base_name is None or config is None:
        return None
    if getattr(config, "_attn_implementation", None) not in _ATTENTION_IMPLEMENTATIONS or config.is_decoder:
        return None
    layers = getattr(getattr(getattr(model, base_name, None), "encoder", None), "layer", None)
    if not isinstance(layers, nn.ModuleList) or not layers:
        return None
    layer = layers[-1]
    attention = getattr(layer, "attention", None)
    parts = (
        getattr(attention, "self", None),
        getattr(attention, "output", None),
        getattr(layer, "intermediate", None),
        getattr(layer, "output", None),
    )
    if any(p is None for p in parts) or not all(hasattr(parts[0], a) for a in ("query", "key", "value")):
        return None
    return layer


def _qualify(model: nn.Module) -> tuple[nn.Module, Callable[..., Any]] | None:
    layer = _last_layer(model)
    if layer is None:
        return None
    param = next(model.parameters())
    config = model.config
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (3, 9), generator=generator).to(param.device)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # padding, so the mask path is checked too
    returns_tuple = False

    def probe(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        nonlocal returns_tuple
        returns_tuple = isinstance(output, tuple)

    with torch.no_grad(), torch.autocast(param.device.type, enabled=False):
        handle = layer.register_forward_hook(probe, with_kwargs=True)
        try:
            full = model(input_ids=ids, attention_mask=mask).logits.float()
        finally:
            handle.remove()
        forward = types.MethodType(_first_token_forward(returns_tuple), layer)
        layer.forward = forward
        try:
            pruned = model(input_ids=ids, attention_mask=mask).logits.float()
        except Exception:  # a layer this code does not know after all: keep the full forward
            return None
        finally:
            del layer.forward
    scale = full.abs().max().clamp_min(1e-12)
    if pruned.shape != full.shape or float((pruned - full).abs().max() / scale) > CHECK_TOLERANCE:
        return None
    return layer, forward


def _first_token_forward(returns_tuple: bool) -> Callable[..., Any]:
    def forward(layer: nn.Module, hidden_states: Tensor, attention_mask: Tensor | None = None, *_: Any, **__: Any):
        out = first_token_layer(layer, hidden_states, attention_mask)
        return (out,) if returns_tuple else out

    return forward


def first_token_layer(layer: nn.Module, hidden: Tensor, mask: Tensor | None) -> Tensor:
    """A BERT-style encoder layer's output [B, 1, H] at the first position of `hidden` [B, S, H]. `mask` is the
    model's prepared attention mask (bool or additive, [B, 1, 1 or S, S]) or None."""
    attn = layer.attention.self
    batch, seq, _ = hidden.shape
    heads, size = attn.num_attention_heads, attn.attention_head_size
    first = hidden[:, :1]
    q = attn.query(first).view(batch, 1, heads, size).transpose(1, 2)
    k = attn.key(hidden).view(batch, seq, heads, size).transpose(1, 2)
    v = attn.value(hidden).view(batch, seq, heads, size).transpose(1, 2)
    if mask is not None:
        mask = mask[:, :, :1] if mask.dim() == 4 else mask
        if mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(batch, 1, -1)
    attended = layer.attention.output(context, first)
    return layer.output(layer.intermediate(attended), attended)
