"""The run kinds table: every kind's engine, profile and screen agree, in every layer that reads it."""

from __future__ import annotations

import importlib

import pytest

from gpuopt_tui.core.kinds import KINDS, engine_available
from gpuopt_tui.ui.screens.registry import SCREEN_NAMES, spec


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_names_its_engine_and_its_screen(kind: str) -> None:
    run_kind = KINDS[kind]
    assert run_kind.name == kind and engine_available(kind)
    engine = importlib.import_module(run_kind.engine)
    assert callable(engine.run_job) and engine.__file__ == str(run_kind.engine_file)
    assert run_kind.screen in SCREEN_NAMES
    screen_spec = spec(run_kind.screen)
    screen = getattr(importlib.import_module(screen_spec.module), screen_spec.factory)
    assert kind == screen.KIND


def test_an_unknown_kind_has_no_engine() -> None:
    assert not engine_available("nonexistent")
