"""Baselines: the reference input each sample's path starts from.

The baseline replaces every *content* token of a sample and keeps its structure: [CLS]/[SEP] (or <s>/</s>)
and padding stay as they are in the input, as is common practice for text IG. Those positions then have
x - baseline = 0, so their attribution is exactly 0 and the whole difference F(x) - F(baseline) is spread
over the words. Content positions get the [PAD], [MASK] or [UNK] token embedding, a user-chosen token's
embedding, or the zero vector ("zero").

"zero-all" is the zero vector at every real position, [CLS]/[SEP] included (only padding, which takes no part
in the output, stays): Captum's LayerIntegratedGradients on the word embeddings with its default baseline
(token id 0 everywhere) computes the same when row 0 of the embedding table is zero, as the [PAD] row of a
Hugging Face BERT is (padding_idx). The structure tokens then get attributions of their own.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.attribution import BASELINES
from gpuopt_tui.jobs.models.base import Adapter

ZERO_ALL = "zero-all"


def baseline_token_id(adapter: Adapter, kind: str, custom_token: str = "") -> int | None:
    """The token id that fills content positions, or None for zero vectors."""
    special = adapter.special_ids
    if kind in ("zero", ZERO_ALL):
        return None
    if kind == "pad":
        token_id = special.pad
    elif kind == "mask":
        token_id = special.mask
    elif kind == "unk":
        token_id = special.unk
    elif kind == "custom":
        token_id = _vocabulary_id(adapter, custom_token)
    else:
        raise UserError(f"attribution.baseline: expected one of {', '.join(BASELINES)}, got {kind!r}")
    if token_id is None:
        raise UserError(
            f"attribution.baseline = {kind}: the tokenizer of {adapter.name} has no {kind} token; "
            "use baseline = zero or custom"
        )
    rows = adapter.word_embeddings().num_embeddings
    if not 0 <= token_id < rows:
        raise UserError(
            f"attribution.baseline = {kind}: token id {token_id} is outside the embedding table of "
            f"{adapter.name} ({rows} rows); use baseline = zero or custom"
        )
    return int(token_id)


def _vocabulary_id(adapter: Adapter, token: str) -> int:
    token_id = adapter.tokenizer.convert_tokens_to_ids(token)
    unknown = adapter.special_ids.unk
    if token_id is None or (token_id == unknown and token != adapter.tokenizer.unk_token):
        raise UserError(
            f'attribution.custom_baseline_token = "{token}" is not a single token of the vocabulary of '
            f"{adapter.name} (give one vocabulary entry, e.g. a word piece as the tokenizer writes it)"
        )
    return int(token_id)


def kept_positions(adapter: Adapter, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Positions the baseline copies from the input: special structure tokens and padding."""
    structure = torch.tensor(sorted(adapter.special_ids.non_content()), dtype=input_ids.dtype)
    return torch.isin(input_ids, structure.to(input_ids.device)) | (attention_mask == 0)


def baseline_embeddings(
    adapter: Adapter,
    input_ids: Tensor,
    attention_mask: Tensor,
    inputs_embeds: Tensor,
    token_id: int | None,
    *,
    keep_structure: bool = True,
) -> Tensor:
    """Baseline embeddings with the shape of `inputs_embeds` [N, *S, H] (see the module docstring); without
    `keep_structure` only padding is kept."""
    table = adapter.word_embeddings()
    if token_id is None:
        fill = torch.zeros((), dtype=inputs_embeds.dtype, device=inputs_embeds.device)
    else:
        with torch.no_grad():
            fill = table(torch.tensor(token_id, device=input_ids.device)).to(inputs_embeds.dtype)
    keep = kept_positions(adapter, input_ids, attention_mask) if keep_structure else attention_mask == 0
    keep = keep.unsqueeze(-1)
    return torch.where(keep, inputs_embeds, fill)
