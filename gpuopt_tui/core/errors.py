"""Errors the user can act on: shown as a message, never as a traceback."""

from __future__ import annotations


class UserError(Exception):
    """A problem with input, files or environment that the user can fix.

    The CLI prints the message and exits non-zero; the TUI shows it in a notification or dialog.
    """


class ProfileError(UserError):
    """A profile file or override that does not match its schema."""

    def __init__(self, source: str, key: str, message: str) -> None:
        self.source = source
        self.key = key
        self.detail = message
        where = f"{source}: " if source else ""
        at = f"key '{key}': " if key else ""
        super().__init__(f"{where}{at}{message}")
