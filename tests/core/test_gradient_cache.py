"""Listing and clearing TracIn's training-gradient cache (core, torch-free) and what `cache --clear` says."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from gpuopt_tui.commands import cache as cache_command
from gpuopt_tui.core.caches import gradients as gradient_cache
from gpuopt_tui.core.caches.features import FeatureCache


def _command(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    parser = argparse.ArgumentParser()
    cache_command.configure(parser)
    assert cache_command.run(parser.parse_args(list(argv))) == 0
    return capsys.readouterr().out


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The gradient cache's folder under a cache dir of the test's own, with wide output."""
    monkeypatch.setenv("GPUOPT_TUI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "300")
    return gradient_cache.default_root()


def test_clear_keeps_symlinked_entries_and_says_so(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (root / "a").mkdir(parents=True)
    (root / "a" / "block_00000.safetensors").write_bytes(b"x" * 10)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "block_00000.safetensors").write_bytes(b"y" * 1000)
    (root / "b").symlink_to(outside)
    features = FeatureCache().root
    features.mkdir(parents=True)
    (tmp_path / "user.npy").write_bytes(b"z" * 500)
    (features / ("c" * 40 + ".npy")).symlink_to(tmp_path / "user.npy")

    out = " ".join(_command(capsys, "--clear").split())
    assert f"removed 0 entries (0 B) from {features}" in out
    assert f"kept {features / ('c' * 40 + '.npy')}: a symbolic link" in out
    assert f"removed 1 TracIn gradient entries (10 B) from {root}" in out
    assert f"kept {root / 'b'}: a symbolic link" in out
    assert (root / "b").is_symlink() and (outside / "block_00000.safetensors").exists()
    assert (tmp_path / "user.npy").exists() and not (root / "a").exists()


def test_a_cache_root_that_is_a_file_lists_as_empty_and_clears_nothing(tmp_path: Path) -> None:
    root = tmp_path / "tracin-gradients"
    root.write_text("not a folder")
    assert gradient_cache.entries(root) == []
    assert gradient_cache.clear(root).removed == 0 and root.read_text() == "not a folder"


def test_the_listing_says_how_each_entry_was_projected(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifests = {
        "a": {"model": "m", "method": "factored", "n_train": 200, "projection": [0, 8, 16, 3]},
        "b": {"model": "m", "method": "factored", "n_train": 200, "projection": [0, 8, 8, 0],
              "projection_basis": ["pca", 256]},
        "c": {"model": "m", "method": "closed_form", "n_train": 50, "projection": [64, 0, 0, 0]},
        "d": {"model": "m", "method": "vmap", "n_train": 50, "projection": [0, 0, 0, 0]},
    }  # fmt: skip
    for key, manifest in manifests.items():
        (root / key).mkdir(parents=True)
        (root / key / "manifest.json").write_text(json.dumps(manifest))
    lines = {line.split()[0]: line for line in _command(capsys, "--list").splitlines() if line[:1] in "abcd"}
    assert "projected 16 x 8 (output x input), seed 3" in lines["a"]
    assert "projected 8 x 8 (output x input), seed 0, PCA directions of 200 examples" in lines["b"]
    assert "projected to <= 64 per tensor, seed 0" in lines["c"] and "exact gradients" in lines["d"]
