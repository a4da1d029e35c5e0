"""The fuzz suite's data directory: crash logs and user profiles of the CLI runs go to a scratch place."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A directory for the damaged files, with GPUOPT_TUI_HOME pointing into it for the module's tests."""
    root = tmp_path_factory.mktemp("fuzz")
    saved = os.environ.get("GPUOPT_TUI_HOME")
    os.environ["GPUOPT_TUI_HOME"] = str(root / "home")
    yield root
    if saved is None:
        del os.environ["GPUOPT_TUI_HOME"]
    else:
        os.environ["GPUOPT_TUI_HOME"] = saved
