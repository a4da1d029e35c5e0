"""CONTRIBUTING's recipe for a new experiment kind names every place a kind is listed, and each of those places
lists every kind of `KINDS` (by its name, or by its screen's name in the screen registry)."""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuopt_tui.core.kinds import KINDS, RunKind
from gpuopt_tui.core.profiles.io import load_profile
from gpuopt_tui.ui.screens.kind import KindScreen
from gpuopt_tui.ui.screens.registry import SCREEN_NAMES, spec
from gpuopt_tui.ui.warmup import WARMED

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOTS = ROOT / "tests" / "ui" / "__snapshots__" / "test_snapshots"


def recipe() -> str:
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    return text.split("## Add an experiment kind", 1)[1].split("\n## ", 1)[0]


def named_paths(text: str) -> set[str]:
    """The repository paths the text names in backquotes (`dir/`, `dir/file.py`)."""
    quoted = re.findall(r"`([^`\s]+)`", text)
    return {q for q in quoted if "/" in q and not q.startswith("core/")}  # `core/x.py`: an example, not a place


def table_keys(path: Path, name: str) -> set[str]:
    """The keys of the dict literal assigned to `name` in a Python file (read, not imported: a test module)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            assert isinstance(node.value, ast.Dict)
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    raise AssertionError(f"no {name} in {path}")


def _profile_module(kind: RunKind) -> bool:
    return kind.profile.__module__ == f"gpuopt_tui.core.profiles.{kind.name}"


def _demo_profile(kind: RunKind) -> bool:
    path = ROOT / "profiles" / f"demo-{kind.name}.toml"
    return path.is_file() and isinstance(load_profile(path), kind.profile)


def _engine(kind: RunKind) -> bool:
    return kind.engine_file.is_file() and kind.engine.startswith("gpuopt_tui.jobs.")


def _kind_screen(kind: RunKind) -> bool:
    screen_spec = spec(kind.screen)
    screen = getattr(importlib.import_module(screen_spec.module), screen_spec.factory)
    in_screens = screen_spec.module.startswith("gpuopt_tui.ui.screens.")
    return in_screens and issubclass(screen, KindScreen) and kind.name == screen.KIND


def _snapshot_tables(kind: RunKind) -> bool:
    tests = ROOT / "tests" / "ui" / "test_snapshots.py"
    return all(kind.screen in table_keys(tests, table) for table in ("LEGIBLE", "RUN_PANE"))


# each place the recipe names, and whether a kind is there
PLACES: dict[str, Callable[[RunKind], bool]] = {
    "gpuopt_tui/core/profiles/<kind>.py": _profile_module,
    "profiles/demo-<kind>.toml": _demo_profile,
    "gpuopt_tui/jobs/": _engine,
    "gpuopt_tui/core/kinds.py": lambda kind: KINDS[kind.name] is kind,
    "tests/test_kinds.py": lambda kind: (ROOT / "tests" / "test_kinds.py").is_file(),  # it walks KINDS
    "gpuopt_tui/ui/screens/": _kind_screen,
    "gpuopt_tui/ui/screens/registry.py": lambda kind: kind.screen in SCREEN_NAMES,
    "gpuopt_tui/ui/warmup.py": lambda kind: kind.screen in WARMED,
    "tests/ui/test_snapshots.py": _snapshot_tables,
    "tests/ui/__snapshots__/test_snapshots/test_screen_snapshot[<screen>-screen].svg": lambda kind: (
        SNAPSHOTS / f"test_screen_snapshot[{kind.screen}-screen].svg"
    ).is_file(),
    "tests/test_contributing.py": lambda kind: True,  # this file
}


def test_the_recipe_names_the_places_this_test_checks() -> None:
    assert named_paths(recipe()) == set(PLACES)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("place", list(PLACES))
def test_each_kind_is_in_each_place(kind: str, place: str) -> None:
    assert PLACES[place](KINDS[kind]), f"kind {kind} is missing from {place}"


def test_a_kind_missing_from_a_place_is_seen() -> None:
    """The checks can fail: a kind whose screen is not warmed or has no snapshot rows is caught."""
    plan = KINDS["plan"]
    unknown = RunKind(plan.profile, plan.engine, "nonexistent")
    failing = [place for place, check in PLACES.items() if not _raises_or(check, unknown)]
    assert {
        "gpuopt_tui/ui/screens/registry.py",
        "gpuopt_tui/ui/warmup.py",
        "tests/ui/test_snapshots.py",
        "tests/ui/__snapshots__/test_snapshots/test_screen_snapshot[<screen>-screen].svg",
        "gpuopt_tui/ui/screens/",
    } <= set(failing)


def _raises_or(check: Callable[[RunKind], bool], kind: RunKind) -> bool:
    try:
        return check(kind)
    except StopIteration:  # spec() of an unknown screen
        return False
