"""`gpuopt-tui plan --apply/--undo` writing real configs: numbered backups through two applies and two undos, undo
refused for a file changed while the user read its diff, a symlinked config, an alias bomb planned within bounded
memory and time, and a config parsed once however many steps read it."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from model_configs import BERT_BASE

from gpuopt_tui.cli import main
from gpuopt_tui.commands import plan as plan_command
from gpuopt_tui.core.planner import yamledit

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "yaml"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(BERT_BASE))
    return path


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_two_applies_and_two_undos_restore_the_original_bytes(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.yaml"
    shutil.copy(CORPUS / "lightning.yaml", config)
    original = config.read_bytes()
    common = ["--config", str(config), "--model", str(model), "--trainable", "lora", "--apply", "--yes"]
    code, out, err = plan(capsys, *common, "--gpu-memory", "24")
    assert code == 0, err
    first = config.read_bytes()
    code, out, err = plan(capsys, *common, "--gpu-memory", "8")
    assert code == 0, err
    assert config.with_name("config.yaml.backup.2").read_bytes() == first
    assert config.with_name("config.yaml.backup.1").read_bytes() == original

    code, out, err = plan(capsys, "--config", str(config), "--undo", "--yes")
    assert code == 0, err
    assert "restored" in out and config.read_bytes() == first
    code, out, err = plan(capsys, "--config", str(config), "--undo", "--yes")
    assert code == 0, err
    assert config.read_bytes() == original
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "model"]
    code, out, err = plan(capsys, "--config", str(config), "--undo", "--yes")
    assert code == 1 and "nothing to undo" in err


def test_undo_refuses_to_discard_a_hand_edit_made_after_the_apply_unless_forced(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.yaml"
    shutil.copy(CORPUS / "lightning.yaml", config)
    original = config.read_bytes()
    common = ["--config", str(config), "--model", str(model), "--trainable", "lora", "--gpu-memory", "24"]
    code, _, err = plan(capsys, *common, "--apply", "--yes")
    assert code == 0, err
    edited = config.read_text() + "# my own note\n"
    config.write_text(edited)

    code, out, err = plan(capsys, "--config", str(config), "--undo", "--yes")
    assert code != 0 and "edited after the planner wrote it" in err and "--force" in err
    assert "+# my own note" in out  # the lines undo would lose are shown
    assert config.read_text() == edited and config.with_name("config.yaml.backup.1").exists()

    code, out, err = plan(capsys, "--config", str(config), "--undo", "--yes", "--force")
    assert code == 0, err
    assert config.read_bytes() == original


def test_undo_is_refused_when_the_file_changes_while_its_diff_is_read(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "config.yaml"
    shutil.copy(CORPUS / "lightning.yaml", config)
    code, _, err = plan(
        capsys, "--config", str(config), "--model", str(model), "--gpu-memory", "24", "--apply", "--yes"
    )
    assert code == 0, err
    edited = config.read_bytes() + b"# tuned by hand\n"

    def edit_then_confirm(out: object, question: str, yes: bool) -> bool:
        config.write_bytes(edited)  # saved in an editor while the diff was on screen
        return True

    monkeypatch.setattr(plan_command, "_confirm", edit_then_confirm)
    code, _, err = plan(capsys, "--config", str(config), "--undo")
    assert code == 1 and "changed since the preview; nothing was restored" in err
    assert config.read_bytes() == edited and config.with_name("config.yaml.backup.1").exists()


def test_a_symlinked_config_is_written_and_restored_at_its_target(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real = tmp_path / "real.yaml"
    shutil.copy(CORPUS / "lightning.yaml", real)
    link = tmp_path / "config.yaml"
    link.symlink_to(real.name)
    original = real.read_bytes()
    code, _, err = plan(capsys, "--config", str(link), "--model", str(model), "--gpu-memory", "24", "--apply", "--yes")
    assert code == 0, err
    assert link.is_symlink() and real.read_bytes() != original
    assert real.with_name("real.yaml.backup.1").read_bytes() == original
    code, _, err = plan(capsys, "--config", str(link), "--undo", "--yes")
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == "real.yaml" and real.read_bytes() == original


LAUGHS = """\
data_loader:
  batch_size: 4
trainer:
  accumulate_grad_batches: 16
a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
"""
LAUGHS += "".join(f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))


def test_an_alias_bomb_is_planned_and_written_in_bounded_memory_and_time(tmp_path: Path, model: Path) -> None:
    """9^9 (387 million) "lol"s once expanded, 1 KB as written: the apply runs in a process limited to 512 MiB of
    address space (expanding them takes gigabytes) and within two minutes on a busy machine (seconds alone)."""
    config = tmp_path / "laughs.yaml"
    config.write_text(LAUGHS)
    assert len(LAUGHS) < 1200
    limit = 512 * 1024**2
    args = ["--config", str(config), "--model", str(model), "--gpu-memory", "24", "--apply", "--yes"]
    code = f"import sys\nfrom gpuopt_tui.cli import main\nsys.exit(main(['plan', *{args!r}]))\n"

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, preexec_fn=cap, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "internal error" not in done.stderr
    data = yamledit.load(config)
    assert data["data_loader"]["batch_size"] != 4 and data["i"][0][0][0][0][0][0][0][0][0] == "lol"
    assert config.with_name("laughs.yaml.backup.1").read_text() == LAUGHS


def test_an_alias_bomb_is_flattened_once_per_node(tmp_path: Path) -> None:
    leaves, shared = yamledit._flatten(yamledit.parse(LAUGHS, "laughs.yaml"))
    assert len(leaves) == 2 + 9 + 8 * 9  # two values, a's nine strings, one leaf per later alias
    assert len(shared) == 8  # a to h are reached more than once


def test_apply_parses_the_config_once_and_its_edited_text_once(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading, composing and previewing the same text share one parse (a round-trip parse of a multi-MB YAML
    takes a minute); the check of the edit parses the new text once."""
    config = tmp_path / "config.yaml"
    body = CORPUS.joinpath("lightning.yaml").read_text()
    config.write_text(body + "vocab:\n" + "".join(f"  tok_{i}: {{id: {i}, weight: 0.5}}\n" for i in range(300)))
    loads: list[int] = []
    real_load = yamledit._load
    monkeypatch.setattr(yamledit, "_parsed", yamledit._ParseCache(8))
    monkeypatch.setattr(yamledit, "_load", lambda text, source: loads.append(len(text)) or real_load(text, source))
    code, _, err = plan(
        capsys, "--config", str(config), "--model", str(model), "--gpu-memory", "24", "--apply", "--yes"
    )
    assert code == 0, err
    assert len([n for n in loads if n > len(body)]) == 2
