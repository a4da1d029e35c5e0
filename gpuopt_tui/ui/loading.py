"""How views read files off the UI thread: one idiom for every view.

A view reads in a method decorated `@work(thread=True, exclusive=True, group=..., exit_on_error=False)` (a new
read cancels the one before it in its group) whose body is `reply(self, what, key, read)`: `read` runs in the
worker thread and its result, or the error it raised, comes back to the view as one `Loaded` message. The
view's `on_loaded` handler tells reads apart by `what` and drops a reply whose `key` (a run id, a request
number) is no longer the one it shows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from textual.message import Message
from textual.message_pump import MessagePump
from textual.worker import get_current_worker

from gpuopt_tui.core.errors import UserError


@dataclass
class Loaded(Message):
    """What a worker read for the node it was started from: `value`, or the `error` that stopped the read;
    `what` names the read and `key` whom it was for."""

    bubble: ClassVar[bool] = False  # for the node that asked only: a parent reads other things

    what: str
    key: Any
    value: Any = None
    error: Exception | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def reason(self) -> str:
        """Why the read failed, in one line ("" when it did not)."""
        if self.error is None:
            return ""
        return str(self.error) if isinstance(self.error, UserError) else f"{type(self.error).__name__}: {self.error}"


def reply(node: MessagePump, what: str, key: Any, read: Callable[[], Any]) -> None:
    """Call `read` (in a thread worker) and post its result to `node` as Loaded, however it ends: an unexpected
    error is posted too, then raised on to the app's report of failed workers. Nothing is posted when the worker
    was cancelled meanwhile (a newer read replaces it)."""
    worker = get_current_worker()
    message = Loaded(what, key)
    try:
        message.value = read()
    except Exception as e:
        message.error = e
        if not isinstance(e, UserError):
            raise
    finally:
        if not worker.is_cancelled:
            node.post_message(message)
