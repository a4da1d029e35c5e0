"""Where gpuopt-tui keeps its data: runs, caches, logs and user profiles.

Everything lives under the platform's user directories (platformdirs) unless overridden:
GPUOPT_TUI_HOME moves data and logs, GPUOPT_TUI_RUNS_DIR moves only the runs, GPUOPT_TUI_CACHE_DIR the cache.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "gpuopt-tui"


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name, "").strip()
    return Path(value).expanduser() if value else None


def data_dir() -> Path:
    return _env_path("GPUOPT_TUI_HOME") or platformdirs.user_data_path(APP_NAME)


def runs_dir() -> Path:
    return _env_path("GPUOPT_TUI_RUNS_DIR") or data_dir() / "runs"


def cache_dir() -> Path:
    home = _env_path("GPUOPT_TUI_HOME")
    return _env_path("GPUOPT_TUI_CACHE_DIR") or (home / "cache" if home else platformdirs.user_cache_path(APP_NAME))


def log_dir() -> Path:
    home = _env_path("GPUOPT_TUI_HOME")
    return home / "logs" if home else platformdirs.user_log_path(APP_NAME)


def config_dir() -> Path:
    home = _env_path("GPUOPT_TUI_HOME")
    return home / "config" if home else platformdirs.user_config_path(APP_NAME)


def shipped_profiles_dir() -> Path:
    """The profiles that come with the package (inside a wheel) or the repository (editable install)."""
    packaged = Path(__file__).resolve().parent.parent / "_profiles"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "profiles"


def user_profiles_dir() -> Path:
    return config_dir() / "profiles"
