"""The planner plans for the demo models from their sizes in core, without a built demo or a child process:
the model it sees is the one the demo code builds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuopt_tui.core.demo_architectures import DEMO_TASKS
from gpuopt_tui.core.planner import session
from gpuopt_tui.core.planner.model_spec import spec_from_config
from gpuopt_tui.jobs.models.demo import KINDS


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_planners_demo_model_is_the_one_the_demo_code_builds(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUOPT_TUI_CACHE_DIR", str(tmp_path))  # no demo built here
    module, _ = KINDS[kind]
    built = json.loads(module.build_config().to_json_string())
    task = DEMO_TASKS[kind]
    assert spec_from_config(session.demo_config(kind), kind, task) == spec_from_config(built, kind, task)
