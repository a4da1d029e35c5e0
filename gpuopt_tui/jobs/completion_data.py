"""Prompt -> completion datasets for causal language models (see models/causal_lm.py for the batch keys).

A dataset is read from jsonl/csv rows (prompt in data.text_field, completion in data.target_field), or its
completions are the model's own greedy continuation (`with_generated_completions`). For a [completion, prompt]
matrix, `per_token_rows` turns each sample into one row per completion token, each explaining that token's
log-probability alone; the rows keep their sample's index in `meta["sample_of_row"]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.attribution import CompletionDataSection
from gpuopt_tui.jobs.data import Row, TextDataset, field_value, trim_batch
from gpuopt_tui.jobs.models.base import to_device
from gpuopt_tui.jobs.models.causal_lm import WHOLE_COMPLETION, CausalLMAdapter

COMPLETIONS = "completions"  # meta key: the completion texts, one per sample (None: not read nor generated yet)
SAMPLE_OF_ROW = "sample_of_row"  # meta key of per-token rows: each row's sample


def string_value(row: Row, key: str) -> str:
    value = field_value(row, key)
    if not isinstance(value, str):
        raise UserError(f'{row[0]}: "{key}" must be a string, got {type(value).__name__}')
    return value


def completion_dataset_from_rows(
    adapter: CausalLMAdapter, rows: Sequence[Row], data: CompletionDataSection
) -> TextDataset:
    """Prompts from data.text_field and, when the rows have it, completions from data.target_field (then every
    row needs one); without any, the completion tensors are empty ([N, 0]) until completions are generated."""
    prompts = [string_value(row, data.text_field) for row in rows]
    tensors = adapter.tokenize(prompts, data.max_length, chat=data.chat_template)
    present = [row[1].get(data.target_field) is not None for row in rows]
    texts: list[str] | None = None
    if any(present):
        if not all(present):
            where = rows[present.index(False)][0]
            field = data.target_field
            raise UserError(f'{where}: missing completion "{field}" (other rows have one; give all or none)')
        texts = [string_value(row, data.target_field) for row in rows]
        tensors |= adapter.completions(texts, data.max_length)
        _check_completions(adapter, tensors, [row[0] for row in rows], data.target_field)
    else:
        empty = torch.zeros(len(rows), 0, dtype=torch.long)
        tensors |= {"completion_ids": empty, "completion_mask": empty.clone()}
    tensors["target_position"] = torch.full((len(rows),), WHOLE_COMPLETION, dtype=torch.long)
    origin = rows[0][0].rsplit(":", 1)[0]
    return TextDataset(tensors, prompts, dict(adapter.token_fields), origin, meta={COMPLETIONS: texts})


def _check_completions(adapter: CausalLMAdapter, tensors: dict[str, Tensor], where: list[str], key: str) -> None:
    """Every completion has a token, and prompt and completion fit the model's positions together."""
    lengths = tensors["completion_mask"].sum(1)
    total = tensors["attention_mask"].sum(1) + lengths
    for i in range(len(where)):
        if int(lengths[i]) == 0:
            raise UserError(f'{where[i]}: the completion "{key}" has no tokens')
        if int(total[i]) > adapter.max_positions:
            raise UserError(
                f"{where[i]}: prompt and completion take {int(total[i])} tokens, more than the "
                f"{adapter.max_positions} positions of {adapter.name} (lower data.max_length or shorten them)"
            )


def has_completions(ds: TextDataset) -> bool:
    return ds.meta.get(COMPLETIONS) is not None


def with_generated_completions(
    adapter: CausalLMAdapter, ds: TextDataset, max_new_tokens: int, batch_size: int
) -> TextDataset:
    """`ds` with each prompt's greedy continuation (models/causal_lm.py `generate`) as its completion."""
    parts: list[dict[str, Tensor]] = []
    for start in range(0, len(ds), batch_size):
        batch = trim_batch(ds.batch(range(start, min(start + batch_size, len(ds)))), {"input_ids": "attention_mask"})
        got = adapter.generate(to_device(batch, adapter.device), max_new_tokens)
        parts.append({k: v.cpu() for k, v in got.items()})
    width = max(p["completion_ids"].shape[1] for p in parts)
    tensors = dict(ds.tensors)
    for key in ("completion_ids", "completion_mask"):
        tensors[key] = torch.cat([_pad_right(p[key], width) for p in parts])
    texts = [
        adapter.tokenizer.decode(ids[mask.bool()].tolist())
        for ids, mask in zip(tensors["completion_ids"], tensors["completion_mask"])
    ]
    return replace(ds, tensors=tensors, meta={**ds.meta, COMPLETIONS: texts})


def _pad_right(t: Tensor, width: int) -> Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def per_token_rows(ds: TextDataset) -> TextDataset:
    """One row per (sample, completion token), in sample order, each explaining that token alone."""
    lengths = ds.tensors["completion_mask"].sum(1)
    sample = torch.repeat_interleave(torch.arange(len(ds)), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    token = torch.arange(len(sample)) - starts[sample]
    tensors = {k: v[sample] for k, v in ds.tensors.items()}
    tensors["target_position"] = token
    texts = [ds.texts[i] for i in sample.tolist()]
    return replace(ds, tensors=tensors, texts=texts, meta={**ds.meta, SAMPLE_OF_ROW: sample})
