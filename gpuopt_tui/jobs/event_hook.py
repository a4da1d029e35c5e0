"""The hook through which an engine's parts report what they did (a chunk size probed, a compile, an
out-of-memory retry): `on_event(type, **fields)`, which the job writes to events.jsonl."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

EventFn = Callable[..., Any]  # on_event(type, **fields)


class EventReporter:
    """Reports events through its `on_event` hook, when it was given one."""

    on_event: EventFn | None

    def _emit(self, type: str, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event(type, **fields)
