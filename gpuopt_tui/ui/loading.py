"""How views read files off the UI thread: one idiom for every view.

A view reads in a method decorated `@work(thread=True, exclusive=True, group=..., exit_on_error=False)` (a new
read cancels the one before it in its group) whose body is `reply(self, ItsReply, key, read)`: `read` runs in
the worker thread and its result, or the error it raised, comes back to the view as one `ItsReply` message,
a subclass of `Loaded` that the view declares for that read. The view handles each reply type with its own
handler (`@on(ItsReply)`) and drops a reply whose `key` (a run id, a request number) is no longer the one it
shows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from textual.message import Message
from textual.message_pump import MessagePump
from textual.worker import get_current_worker

from gpuopt_tui.core.errors import UserError


@dataclass
class Loaded(Message, bubble=False):
    """What a worker read for the node it was started from: `value`, or the `error` that stopped the read; `key`
    says whom it was for. A view declares a subclass for each kind of read it makes."""

    key: Any
    value: Any = None
    error: Exception | None = None

    # For the node that asked only (a parent reads other things): `bubble=False` above and in every subclass
    # (a class attribute would not do: Textual sets `bubble` on each subclass, True unless told otherwise).
    def __init_subclass__(cls, **kwargs: Any) -> None:
        kwargs.setdefault("bubble", False)
        super().__init_subclass__(**kwargs)

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def reason(self) -> str:
        """Why the read failed, in one line ("" when it did not)."""
        if self.error is None:
            return ""
        return str(self.error) if isinstance(self.error, UserError) else f"{type(self.error).__name__}: {self.error}"


def reply(node: MessagePump, reply_type: type[Loaded], key: Any, read: Callable[[], Any]) -> None:
    """Call `read` (in a thread worker) and post its result to `node` as a `reply_type` message, however it ends:
    an unexpected error is posted too, then raised on to the app's report of failed workers. Nothing is posted
    when the worker was cancelled meanwhile (a newer read replaces it)."""
    worker = get_current_worker()
    message = reply_type(key)
    try:
        message.value = read()
    except Exception as e:
        message.error = e
        if not isinstance(e, UserError):
            raise
    finally:
        if not worker.is_cancelled:
            node.post_message(message)
