"""A leaner exact forward for BERT-style classifiers while only their logits are read.

A BERT-style classifier (BERT, RoBERTa, ELECTRA, ...) feeds its head with the final hidden state of the first
token alone. In the last encoder layer every other position still needs its keys and values (the first token
attends to them), but its query, attention output, feed-forward block and layer norms only matter for the first
token: computing them for one position instead of all is exact and skips about 5/6 of that layer's work, in the
forward and the backward pass alike (~7% of a 12-layer model, ~20% of a 4-layer one).

`first_token_only(model)` swaps in, for the base model (`model.bert`, ...), an encoder pass that does this and
runs attention itself: the fused kernels of short_attention.py where they apply (fp16/bf16 on a GPU, up to 128
tokens), else `scaled_dot_product_attention`; with the padding mask as [N, 1, 1, S], or with no mask at all when
the caller passes none (a batch without padding): the attention kernels without a mask are the fastest, and the
library's own mask preparation would build a full mask under torch.compile. The head is the model's own, and
parameter names and values are untouched, so functional calls and hooks on the layers keep working. A model
qualifies only if its structure matches and a check on random tokens, with and without padding, gives the same
logits as the full forward; otherwise the context does nothing.
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

from gpuopt_tui.jobs import short_attention

#: How close the lean logits must be to the full ones (fp32, relative to their largest magnitude).
CHECK_TOLERANCE = 1e-4
#: Heads known to read the first token only (class name of the model -> its base model attribute).
FIRST_TOKEN_HEADS = {
    "BertForSequenceClassification": "bert",
    "RobertaForSequenceClassification": "roberta",
    "XLMRobertaForSequenceClassification": "roberta",
    "CamembertForSequenceClassification": "roberta",
    "ElectraForSequenceClassification": "electra",
}
_ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")

# model -> (base model, the bound lean forward to install), or None when the model does not qualify. One
# forward object per model, so a compiled graph guarding on the base model's forward sees the same object.
_verdicts: weakref.WeakKeyDictionary[nn.Module, tuple[nn.Module, Callable[..., Any]] | None] = (
    weakref.WeakKeyDictionary()
)


@contextlib.contextmanager
def first_token_only(model: nn.Module) -> Iterator[bool]:
    """Within the block the model runs the lean forward (if it qualifies, see the module docstring); yields
    whether it does. Only logits may be read meanwhile, not hidden states or attentions."""
    if model not in _verdicts:
        _verdicts[model] = _qualify(model)
    verdict = _verdicts[model]
    if verdict is None or "forward" in vars(verdict[0]):  # not applicable, or already inside such a block
        yield verdict is not None
        return
    base, forward = verdict
    base.forward = forward
    try:
        yield True
    finally:
        del base.forward


def _base_model(model: nn.Module) -> nn.Module | None:
    base_name = FIRST_TOKEN_HEADS.get(type(model).__name__)
    config = getattr(model, "config", None)
    if base_name is None or config is None:
        return None
    if getattr(config, "_attn_implementation", None) not in _ATTENTION_IMPLEMENTATIONS or config.is_decoder:
        return None
    base = getattr(model, base_name, None)
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    if not isinstance(layers, nn.ModuleList) or not layers or not hasattr(base, "embeddings"):
        return None
    for layer in layers:
        attention = getattr(layer, "attention", None)
        attn = getattr(attention, "self", None)
        if not all(hasattr(attn, a) for a in ("query", "key", "value", "num_attention_heads")):
            return None
        if not all(hasattr(m, a) for m, a in ((attention, "output"), (layer, "intermediate"), (layer, "output"))):
            return None
    return base


def _qualify(model: nn.Module) -> tuple[nn.Module, Callable[..., Any]] | None:
    base = _base_model(model)
    if base is None:
        return None
    forward = types.MethodType(_lean_forward, base)
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0)).to(device)
    padded = torch.ones_like(ids)
    padded[1, 6:] = 0
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        full = [model(input_ids=ids, attention_mask=mask).logits.float() for mask in (padded, None)]
        base.forward = forward
        try:
            lean = [model(input_ids=ids, attention_mask=mask).logits.float() for mask in (padded, None)]
        except Exception:  # a layout this code does not know after all: keep the full forward
            return None
        finally:
            del base.forward
    for a, b in zip(lean, full):
        scale = b.abs().max().clamp_min(1e-12)
        if a.shape != b.shape or float((a - b).abs().max() / scale) > CHECK_TOLERANCE:
            return None
    return base, forward


def _lean_forward(
    base: nn.Module,
    input_ids: Tensor | None = None,
    attention_mask: Tensor | None = None,
    token_type_ids: Tensor | None = None,
    position_ids: Tensor | None = None,
    inputs_embeds: Tensor | None = None,
    **_: Any,
) -> Any:
    """The base model's forward up to the first token's final hidden state (and its pooler output)."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    hidden = base.embeddings(
        input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids, inputs_embeds=inputs_embeds
    )
    if hasattr(base, "embeddings_project"):  # ELECTRA with embeddings narrower than the hidden size
        hidden = base.embeddings_project(hidden)
    mask = _attention_mask(attention_mask, hidden.dtype)
    layers = base.encoder.layer
    for i, layer in enumerate(layers):
        hidden = encoder_layer(layer, hidden, mask, first_only=i == len(layers) - 1)
    pooler = getattr(base, "pooler", None)
    pooled = None if pooler is None else pooler(hidden)
    return BaseModelOutputWithPooling(last_hidden_state=hidden, pooler_output=pooled)


def _attention_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """None, or a mask `scaled_dot_product_attention` broadcasts: [N, 1, 1, S] bool from a 2D padding mask; an
    already prepared 4D mask (bool, or additive in the hidden dtype) as it is."""
    if mask is None:
        return None
    if mask.dim() == 4:
        return mask if mask.dtype == torch.bool else mask.to(dtype)
    return mask[:, None, None, :].bool()


def encoder_layer(layer: nn.Module, hidden: Tensor, mask: Tensor | None, *, first_only: bool) -> Tensor:
    """A BERT-style encoder layer on `hidden` [B, S, H]: [B, S, H], or [B, 1, H] for the first position only."""
    attn = layer.attention.self
    batch, seq, _ = hidden.shape
    heads = attn.num_attention_heads
    queries = hidden[:, :1] if first_only else hidden
    q = attn.query(queries).view(batch, queries.shape[1], heads, -1)
    k = attn.key(hidden).view(batch, seq, heads, -1)
    v = attn.value(hidden).view(batch, seq, heads, -1)
    key_mask = _key_mask(mask, batch)
    if not first_only and (mask is None or key_mask is not None) and short_attention.supports(q, key_mask):
        context = short_attention.short_attention(q, k, v, key_mask)
    else:
        if mask is not None and first_only and mask.shape[-2] != 1:
            mask = mask[:, :, :1]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    context = context.reshape(batch, queries.shape[1], -1)
    attended = layer.attention.output(context, queries)
    return layer.output(layer.intermediate(attended), attended)


def _key_mask(mask: Tensor | None, batch: int) -> Tensor | None:
    """A [N, 1, 1, S] bool mask as [batch, S] (True = attend); None for no mask or any other form."""
    if mask is None or mask.dtype != torch.bool or mask.shape[1:3] != (1, 1):
        return None
    return mask[:, 0, 0, :].expand(batch, -1)
