"""Prompt -> completion datasets for causal language models (see models/causal_lm.py for the batch keys).

A dataset is read from jsonl/csv rows (prompt in data.text_field, completion in data.target_field), or from jsonl rows
of chat messages (data.messages_field; see chat_messages.py), or its completions are the model's own greedy
continuation (`with_generated_completions`). For a [completion, prompt]
matrix, `per_token_rows` turns each sample into one row per completion token, each explaining that token's
log-probability alone; the rows keep their sample's index in `meta["sample_of_row"]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from jinja2 import TemplateError
from torch import Tensor

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.attribution import CompletionDataSection
from gpuopt_tui.jobs.chat_messages import Message, conversation, prompts_and_completions, shown_prompt
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
    """Prompts and completions from chat messages (data.messages_field) or from data.text_field and, when the rows
    have it, data.target_field (then every row needs one); without completions, the completion tensors are empty
    ([N, 0]) until completions are generated."""
    origin = rows[0][0].rsplit(":", 1)[0]
    if data.messages_field:
        prompts, tensors, completions = _message_rows(adapter, rows, data, origin)
    else:
        prompts, tensors, completions = _field_rows(adapter, rows, data)
    if completions is not None:
        tensors |= adapter.completions(completions, data.max_length)
        _check_completions(adapter, tensors, [row[0] for row in rows], _completion_name(data))
    else:
        empty = torch.zeros(len(rows), 0, dtype=torch.long)
        tensors |= {"completion_ids": empty, "completion_mask": empty.clone()}
    tensors["target_position"] = torch.full((len(rows),), WHOLE_COMPLETION, dtype=torch.long)
    return TextDataset(tensors, prompts, dict(adapter.token_fields), origin, meta={COMPLETIONS: completions})


def missing_completions(data: CompletionDataSection) -> str:
    """Why a dataset has no completions, in words (for the messages that refuse such a dataset)."""
    if data.messages_field:
        return f'the conversations in "{data.messages_field}" end before the assistant\'s message'
    return f'data.target_field = "{data.target_field}" is in no row'


def completion_source(data: CompletionDataSection) -> str:
    """Where a dataset's completions were read from, in words (for the run's summary)."""
    if data.messages_field:
        return (
            f'data.messages_field = "{data.messages_field}": the last (assistant) message; the prompt is the '
            "tokenizer's chat template over the messages before it"
        )
    return f'data.target_field = "{data.target_field}"'


def _completion_name(data: CompletionDataSection) -> str:
    if data.messages_field:
        return f'the completion (the last message in "{data.messages_field}")'
    return f'the completion "{data.target_field}"'


#: what a reader returns: the prompts' texts as shown, their tensors, the completions (None: the rows have none)
_Read = tuple[list[str], dict[str, Tensor], list[str] | None]


def _field_rows(adapter: CausalLMAdapter, rows: Sequence[Row], data: CompletionDataSection) -> _Read:
    prompts = [string_value(row, data.text_field) for row in rows]
    tensors = adapter.tokenize(prompts, data.max_length, chat=data.chat_template)
    present = [row[1].get(data.target_field) is not None for row in rows]
    if not any(present):
        return prompts, tensors, None
    if not all(present):
        where = rows[present.index(False)][0]
        field = data.target_field
        raise UserError(f'{where}: missing completion "{field}" (other rows have one; give all or none)')
    return prompts, tensors, [string_value(row, data.target_field) for row in rows]


def _message_rows(adapter: CausalLMAdapter, rows: Sequence[Row], data: CompletionDataSection, origin: str) -> _Read:
    """Each row's prompt messages (chat_messages.prompts_and_completions) through the chat template, with the
    generation prompt, and the completions (None when the conversations end before the assistant's turn)."""
    setting = f'data.messages_field = "{data.messages_field}" ({origin}) renders prompts with the chat template'
    chats = [conversation(row, data.messages_field) for row in rows]
    prompts, completions = prompts_and_completions(rows, chats, data.messages_field)
    rendered = [_rendered(adapter, row[0], prompt, setting) for row, prompt in zip(rows, prompts)]
    tensors = adapter.tokenize_templated(rendered, data.max_length)
    return [shown_prompt(prompt) for prompt in prompts], tensors, completions


def _rendered(adapter: CausalLMAdapter, where: str, messages: list[Message], setting: str) -> str:
    try:
        return adapter.chat_prompt(messages, setting)
    except TemplateError as exc:  # a template may refuse a conversation (roles out of turn, an unknown role)
        raise UserError(f"{where}: the chat template of {adapter.name} refused the messages: {exc}") from None


def _check_completions(adapter: CausalLMAdapter, tensors: dict[str, Tensor], where: list[str], name: str) -> None:
    """Every prompt and completion has a token (the first completion token is predicted from the prompt), and they
    fit the model's positions together."""
    prompts = tensors["attention_mask"].sum(1).tolist()  # lists: a loop over tensor elements costs per row
    lengths = tensors["completion_mask"].sum(1).tolist()
    for at, prompt, length in zip(where, prompts, lengths, strict=True):
        if prompt == 0:
            raise UserError(f"{at}: the prompt has no tokens (the completion's first token needs one before it)")
        if length == 0:
            raise UserError(f"{at}: {name} has no tokens")
        if prompt + length > adapter.max_positions:
            raise UserError(
                f"{at}: prompt and completion take {prompt + length} tokens, more than the "
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
