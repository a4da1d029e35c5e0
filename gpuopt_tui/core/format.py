"""Human-readable figures shared by the CLI and the TUI."""

from __future__ import annotations

import re
import time

# C0 and C1 control characters except tab and newline: an escape sequence read from a file (a run's message,
# a trace's GPU name) must never reach the terminal raw.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def human_bytes(n: float | None) -> str:
    if n is None:
        return "N/A"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def human_duration(seconds: float | None) -> str:
    if seconds is None:
        return "--"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def human_time(timestamp: float | None) -> str:
    if not timestamp:
        return "--"
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp))
    except (OverflowError, OSError, ValueError, TypeError):
        return "?"


def safe_text(text: object) -> str:
    """`text` as a string with control characters shown as `?`: for anything read from a file or a process."""
    return _CONTROL.sub("?", str(text))


def with_article(word: str) -> str:
    """`word` after "a" or "an", by its first letter: "an ablation", "a tracin"."""
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"
