"""The layers keep their imports: the TUI never loads torch or transformers (not even indirectly), core/ is
free of Textual, Rich and torch, jobs/ never loads Textual. Checked by running the real import paths in fresh
processes, and by reading every module's import statements. core/ keeps its modules in packages named by what
they hold (runs, results, caches, planner, ...), with few at its root."""

from __future__ import annotations

import ast
import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gpuopt_tui"
HEAVY = ("torch", "transformers")
CORE_FORBIDDEN = (*HEAVY, "textual", "rich")  # core draws nothing: the CLI and the app give its data styles
CORE = PACKAGE / "core"
CORE_PACKAGES = sorted(p.parent.name for p in CORE.glob("*/__init__.py"))
MAX_CORE_ROOT_MODULES = 12


def _modules(folder: Path) -> list[str]:
    return sorted(
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for p in folder.rglob("*.py")
    )


UI_MODULES = _modules(PACKAGE / "ui")


def _env(tmp_path: Path) -> dict[str, str]:
    return dict(os.environ, GPUOPT_TUI_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")


def test_importing_the_app_and_every_ui_module_loads_no_torch(tmp_path: Path) -> None:
    code = (
        "import importlib, json, sys\n"
        "import gpuopt_tui.app\n"
        f"for name in {UI_MODULES!r}: importlib.import_module(name)\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(tmp_path), timeout=60, check=True
    )
    assert json.loads(out.stdout) == []


def test_importing_every_core_module_loads_neither_torch_nor_textual_nor_rich(tmp_path: Path) -> None:
    code = (
        "import importlib, json, sys\n"
        f"for name in {_modules(CORE)!r}: importlib.import_module(name)\n"
        f"print(json.dumps([m for m in {CORE_FORBIDDEN!r} if m in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(tmp_path), timeout=60, check=True
    )
    assert json.loads(out.stdout) == []


FIRST_FRAME = """
import json, sys
import gpuopt_tui.app as app_module
from gpuopt_tui import cli

original = app_module.GpuOptApp.on_ready

def on_ready(self):
    original(self)
    heavy = [m for m in ("torch", "transformers") if m in sys.modules]
    with open(sys.argv[1], "w") as f:
        json.dump({"startup_seconds": self.startup_seconds, "heavy": heavy, "screen": self.current_mode}, f)
    self.exit()

app_module.GpuOptApp.on_ready = on_ready
sys.exit(cli.main([]))
"""


def test_tui_first_frame_comes_without_torch(tmp_path: Path) -> None:
    """`gpuopt-tui` in a real terminal (a pty, 120x40) up to its first painted frame."""
    result = tmp_path / "first-frame.json"
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = _env(tmp_path) | {"TERM": "xterm-256color"}
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", FIRST_FRAME, str(result)], stdin=slave, stdout=slave, stderr=slave, env=env
    )
    os.close(slave)
    drained: list[bytes] = []

    def drain() -> None:  # the terminal must be read, or the app blocks writing its frame
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                return
            if not chunk:
                return
            drained.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    wall = time.perf_counter() - started
    assert proc.returncode == 0, b"".join(drained)[-2000:]
    data = json.loads(result.read_text())
    assert data["heavy"] == []
    assert data["screen"] == "dashboard"
    print(f"\nfirst frame {data['startup_seconds']:.3f} s after process start (run to exit {wall:.2f} s)")


def _imports(path: Path) -> set[str]:
    """Top-level names of every module a file imports (at any depth of the file)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _offenders(folder: Path, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for path in sorted(folder.rglob("*.py")):
        bad = sorted(n for n in _imports(path) if n.split(".")[0] in forbidden or n.startswith(forbidden))
        if bad:
            found[str(path.relative_to(PACKAGE.parent))] = bad
    return found


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        ("core", CORE_FORBIDDEN),
        ("jobs", ("textual",)),
        ("ui", ("torch", "transformers", "gpuopt_tui.jobs")),
    ],
)
def test_layers_do_not_import_across(folder: str, forbidden: tuple[str, ...]) -> None:
    assert _offenders(PACKAGE / folder, forbidden) == {}


def test_app_module_imports_no_engine() -> None:
    names = _imports(PACKAGE / "app.py")
    assert not [n for n in names if n.split(".")[0] in HEAVY or n.startswith("gpuopt_tui.jobs")]


@pytest.mark.parametrize("package", CORE_PACKAGES)
def test_each_core_package_imports_neither_torch_nor_textual_nor_rich(package: str) -> None:
    assert _offenders(CORE / package, CORE_FORBIDDEN) == {}


def test_core_groups_its_modules_into_packages() -> None:
    """A module added to core goes into the package of what it holds; every folder of modules is a package (so
    the per-package check above sees it), and core's root keeps only what every part shares."""
    root_modules = sorted(p.stem for p in CORE.glob("*.py") if p.stem != "__init__")
    assert len(root_modules) <= MAX_CORE_ROOT_MODULES, root_modules
    folders = {p.parent for p in CORE.rglob("*.py")} - {CORE}
    assert sorted(str(f.relative_to(CORE)) for f in folders if not (f / "__init__.py").exists()) == []
    assert {"runs", "results", "caches", "planner", "profiles", "telemetry"} <= set(CORE_PACKAGES)


@pytest.mark.parametrize("folder", ["jobs", "core"])
def test_engine_and_core_tests_import_no_ui(folder: str) -> None:
    """tests/jobs and tests/core run on the GPU machine, where only the engines' packages are installed."""
    tests = Path(__file__).parent / folder
    found = {
        path.name: bad
        for path in sorted(tests.rglob("*.py"))
        if (
            bad := sorted(
                n for n in _imports(path) if n.split(".")[0] in ("textual", "rich") or n.startswith("gpuopt_tui.ui")
            )
        )
    }
    assert found == {}
