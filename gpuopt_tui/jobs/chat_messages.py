"""Chat-message rows of a causal LM dataset (data.messages_field), as fine-tuning sets usually come:

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}]}

The last message is the assistant's: it is the completion; the messages before it are the prompt, which the
tokenizer's chat template renders (completion_data.py tokenizes both). Conversations may instead all end before the
assistant's turn: then every message is the prompt and there is no completion to read (an attribution run with
target = "generate" writes the model's own). A person reads the prompt as "role: content" lines (`shown_prompt`),
which is the `text` the results keep.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.data import Row, field_value, shown_text

Message = dict[str, Any]
COMPLETION_ROLE = "assistant"


def conversation(row: Row, key: str) -> list[Message]:
    """The row's messages at `key`, checked: a list of objects with string "role" and "content"; one that ends with
    the assistant's message has at least one before it (the prompt)."""
    where = row[0]
    value = field_value(row, key)
    expected = f'"{key}" must be a non-empty list of {{"role": ..., "content": ...}} messages'
    if isinstance(value, str):
        raise UserError(f"{where}: {expected}, got a string (messages rows need a jsonl file, the list as JSON)")
    if not isinstance(value, list) or not value:
        got = "an empty list" if isinstance(value, list) else type(value).__name__
        raise UserError(f"{where}: {expected}, got {got}")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not all(isinstance(message.get(k), str) for k in ("role", "content")):
            got = shown_text(json.dumps(message, ensure_ascii=False), 80)
            raise UserError(f'{where}: {key}[{i}] must be an object with string "role" and "content", got {got}')
    if len(value) == 1 and value[0]["role"] == COMPLETION_ROLE:
        raise UserError(f'{where}: "{key}" holds only the {COMPLETION_ROLE}\'s message: the prompt needs one before it')
    return value


def prompts_and_completions(
    rows: Sequence[Row], chats: list[list[Message]], key: str
) -> tuple[list[list[Message]], list[str] | None]:
    """(each row's prompt messages, the completions): when every conversation ends with the assistant's message,
    that message is the completion; when none does, the whole conversation is the prompt and there are no
    completions (None); a mix is refused, naming the first row that differs from the first."""
    ends = [chat[-1]["role"] == COMPLETION_ROLE for chat in chats]
    if all(ends):
        return [chat[:-1] for chat in chats], [chat[-1]["content"] for chat in chats]
    if not any(ends):
        return chats, None
    odd = ends.index(not ends[0])
    first, this = (f'role "{shown_text(chats[i][-1]["role"])}"' for i in (0, odd))
    raise UserError(
        f'{rows[odd][0]}: the conversations in "{key}" must all end with the {COMPLETION_ROLE}\'s message (the '
        f'completion) or all before it (attribution.target = "generate" then writes it); this one ends with {this}, '
        f"{rows[0][0]}'s with {first}"
    )


def shown_prompt(messages: Sequence[Message]) -> str:
    """The prompt messages as a person reads them: one "role: content" line each."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)
