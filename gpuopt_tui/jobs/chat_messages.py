"""Chat-message rows of a causal LM dataset (data.messages_field), as fine-tuning sets usually come:

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}]}

The last message is the assistant's: it is the completion; the messages before it are the prompt, which the
tokenizer's chat template renders (completion_data.py tokenizes both). A person reads the prompt as "role: content"
lines (`shown_prompt`), which is the `text` the results keep.
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
    """The row's messages at `key`, checked: a list of objects with string "role" and "content", the last one the
    assistant's and at least one before it (the prompt)."""
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
    role = value[-1]["role"]
    if role != COMPLETION_ROLE:
        raise UserError(
            f'{where}: the last message of "{key}" must be the {COMPLETION_ROLE}\'s (it is the completion), '
            f'got role "{shown_text(role)}"'
        )
    if len(value) == 1:
        raise UserError(f'{where}: "{key}" holds only the {COMPLETION_ROLE}\'s message: the prompt needs one before it')
    return value


def shown_prompt(messages: Sequence[Message]) -> str:
    """The prompt messages as a person reads them: one "role: content" line each."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)
