"""Human-readable figures shared by the CLI and the TUI."""

from __future__ import annotations

import time


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
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp))
