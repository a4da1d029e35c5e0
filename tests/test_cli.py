"""The headless CLI: help everywhere, and bad input as a clear message with a non-zero exit, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuopt_tui.cli import build_parser, main
from gpuopt_tui.core.kinds import KINDS
from gpuopt_tui.core.profiles.schema import describe


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuopt_tui", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def subcommands() -> list[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return sorted(action.choices)


def test_help_of_the_command_and_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    names = subcommands()
    assert {"run", "runs", "attach", "cancel", "resume", "show", "profiles"} <= set(names)
    for args in ([], *([n] for n in names)):
        with pytest.raises(SystemExit) as done:
            main([*args, "--help"])
        assert done.value.code == 0
        assert "usage: gpuopt-tui" in capsys.readouterr().out


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(f"    {name} " in out for name in subcommands()), out


def test_the_tui_command_line_imports_no_subcommand_module() -> None:
    code = (
        "import sys; from gpuopt_tui.cli import parse_args\n"
        "args = parse_args(['--readonly', '--screen', 'gpu', '--replay', 'trace.jsonl'])\n"
        "print(args.readonly, args.screen, args.replay, [m for m in sys.modules if m.startswith('gpuopt_tui.commands')])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.split() == ["True", "gpu", "trace.jsonl", "[]"]


def test_a_subcommand_line_imports_only_its_own_command_module() -> None:
    """`gpuopt-tui run` starts its run sooner for not importing the other commands first."""
    code = (
        "import sys; from gpuopt_tui.cli import parse_args\n"
        "args = parse_args(['--runs-dir', 'runs', 'run', 'demo-attribution', '--set', 'n_steps=8', '--detach'])\n"
        "print(args.command, args.profile, args.detach, sorted(m for m in sys.modules if m.startswith('gpuopt_tui.commands.')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.split() == ["run", "demo-attribution", "True", "['gpuopt_tui.commands.run']"]


def test_help_runs_as_a_process_without_importing_torch() -> None:
    code = "import sys; from gpuopt_tui.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("profile_text", "args", "message"),
    [
        ('kind = "attribution"\n[attribution\n', [], "not valid TOML"),
        ('kind = "probing"\n', [], "unknown run kind 'probing'"),
        ('kind = "attribution"\n[model]\nadapter = "hf"\npath = "no/such/model"\n', [], "key 'model.path'"),
        ('kind = "attribution"\n', ["--set", "n_steps=zero"], 'expected an integer or "auto", got "zero"'),
    ],
)
def test_run_with_bad_input_fails_cleanly(tmp_path: Path, profile_text: str, args: list[str], message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(profile_text)
    result = cli("run", str(path), *args, env={"GPUOPT_TUI_HOME": str(tmp_path / "home")})
    assert result.returncode == 1
    assert message in result.stderr
    assert result.stderr.startswith(f"gpuopt-tui: error: {'--set ' + args[1] if args else path}: ")  # the culprit
    assert "Traceback" not in result.stderr + result.stdout


def test_unwritable_runs_dir_fails_cleanly(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = cli("--runs-dir", str(blocker / "runs"), "run", "demo-attribution", "--detach")
    assert result.returncode == 1
    assert "cannot create the run directory" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["attach", "cancel", "resume", "show"])
def test_unknown_run_id(tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    os.environ["GPUOPT_TUI_RUNS_DIR"] = str(tmp_path)
    try:
        assert main([command, "no-such-run"]) == 1
    finally:
        del os.environ["GPUOPT_TUI_RUNS_DIR"]
    assert "no run 'no-such-run'" in capsys.readouterr().err


def test_profiles_listing_and_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profiles"]) == 0
    out = capsys.readouterr().out
    assert "demo-attribution" in out and "demo-tracin" in out
    assert main(["profiles", "--keys", "attribution"]) == 0
    assert "attribution.n_steps" in capsys.readouterr().out
    assert main(["profiles", "--show", "demo-attribution", "--set", "n_steps=9"]) == 0
    assert "n_steps = 9" in capsys.readouterr().out


def test_profile_keys_piped_keep_each_help_whole_and_readable(tmp_path: Path) -> None:
    """Piped (no terminal) at 80 columns: each key on its line, its help below it in lines of usable width."""
    env = {"COLUMNS": "80", "GPUOPT_TUI_HOME": str(tmp_path)}
    result = cli("profiles", "--keys", "attribution", env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    help_lines = [line for line in lines if line.startswith("    ")]
    assert help_lines and all(len(line) <= 80 for line in help_lines)
    for f in describe(KINDS["attribution"].profile):
        start = next(n for n, line in enumerate(lines) if line.startswith(f"{f.key}  "))
        shown = []
        for line in lines[start + 1 :]:  # a long key line wraps first, then its help follows, indented
            if line.startswith("    "):
                shown.append(line.strip())
            elif shown:
                break
        assert " ".join(shown) == " ".join(f.help.split())


@pytest.mark.parametrize("columns", [80, 120])
def test_listings_never_cut_or_wrap_ids_and_names(columns: int, tmp_path: Path) -> None:
    """Run ids, statuses and profile names stay whole on their line at 80 and 120 columns; the other columns
    give way, and the ones the id spells (kind, created) go first."""
    frozen = Path(__file__).parent / "fixtures" / "browse_runs"
    env = {"COLUMNS": str(columns), "GPUOPT_TUI_HOME": str(tmp_path), "GPUOPT_TUI_RUNS_DIR": str(frozen)}
    runs = cli("runs", env=env)
    assert runs.returncode == 0, runs.stderr
    ids = sorted(p.name for p in frozen.iterdir() if p.is_dir())
    lines = runs.stdout.splitlines()
    assert all(len(line.rstrip()) <= columns for line in lines[:-1])  # the last: the runs directory, whole
    assert sorted(line.split()[0] for line in lines[1:-1]) == ids
    assert all("finished" in line.split() for line in lines[1:-1])  # the status is never cut
    assert lines[-1] == f"runs directory: {frozen}"
    profiles = cli("profiles", env=env)
    assert profiles.returncode == 0, profiles.stderr
    names = sorted(p.stem for p in (Path(__file__).parents[1] / "profiles").glob("*.toml"))
    starts = [line.split()[0] for line in profiles.stdout.splitlines()[1:] if not line.startswith(" " * 3)]
    assert sorted(starts) == names


def test_internal_errors_go_to_a_log_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("GPUOPT_TUI_HOME", str(tmp_path))

    def boom(args: object) -> int:
        raise RuntimeError("unexpected")

    monkeypatch.setattr("gpuopt_tui.commands.runs.run", boom)
    assert main(["runs"]) == 1
    err = capsys.readouterr().err
    assert "internal error: RuntimeError: unexpected" in err
    log = tmp_path / "logs" / "gpuopt-tui.log"
    assert "Traceback" in log.read_text() and str(log) in err
