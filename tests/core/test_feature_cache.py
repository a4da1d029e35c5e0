"""The feature cache (core, torch-free) and the `cache` CLI subcommand."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpuopt_tui.commands import cache as cache_command
from gpuopt_tui.core.caches import features as feature_cache
from gpuopt_tui.core.caches import files as cache_files
from gpuopt_tui.core.caches.features import FeatureCache, cache_key


def _array(seed: int = 0, shape: tuple[int, ...] = (50, 7)) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_store_then_load_is_a_hit_with_the_same_values(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path)
    key = cache_key({"input": "abc", "representation": "svd_topk"})
    assert cache.load(key) is None
    cache.store(key, _array(), {"representation": "svd_topk", "layer": "layer.1"})
    loaded = cache.load(key, shape=(50, -1))
    assert loaded is not None and np.array_equal(loaded, _array())
    assert (cache.stats.hits, cache.stats.misses, cache.stats.corrupt) == (1, 1, 0)


def test_cache_key_is_stable_and_depends_on_every_part() -> None:
    a = cache_key({"input": "x", "settings": {"top_k": 10, "seed": 0}})
    assert a == cache_key({"settings": {"seed": 0, "top_k": 10}, "input": "x"})
    assert a != cache_key({"input": "x", "settings": {"top_k": 11, "seed": 0}})
    assert a != cache_key({"input": "y", "settings": {"top_k": 10, "seed": 0}})


def test_corrupt_array_is_detected_removed_and_reported(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path)
    cache.store("k1", _array(), {})
    path = cache.array_path("k1")
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # one flipped byte in the data, size unchanged
    path.write_bytes(bytes(raw))
    assert cache.load("k1") is None
    assert cache.stats.corrupt == 1
    assert not path.exists() and not cache.manifest_path("k1").exists()
    cache.store("k1", _array(), {})  # recomputed and stored again
    assert np.array_equal(cache.load("k1"), _array())


@pytest.mark.parametrize(
    "damage",
    ["truncate", "manifest_garbage", "other_format", "other_key", "no_manifest"],
)
def test_damaged_or_stale_entries_are_misses(tmp_path: Path, damage: str) -> None:
    cache = FeatureCache(tmp_path)
    cache.store("k1", _array(), {})
    manifest = cache.manifest_path("k1")
    data = json.loads(manifest.read_text())
    if damage == "truncate":
        cache.array_path("k1").write_bytes(cache.array_path("k1").read_bytes()[:-8])
    elif damage == "manifest_garbage":
        manifest.write_text("{not json")
    elif damage == "other_format":
        manifest.write_text(json.dumps({**data, "format": feature_cache.FORMAT + 1}))
    elif damage == "other_key":
        manifest.write_text(json.dumps({**data, "key": "k2"}))
    else:
        manifest.unlink()
    assert cache.load("k1") is None
    assert cache.stats.hits == 0


def test_entry_with_another_shape_is_stale(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path)
    cache.store("k1", _array(), {})
    assert cache.load("k1", shape=(51, -1)) is None  # e.g. a different number of samples
    assert cache.stats.corrupt == 1


def test_aborted_write_leaves_nothing(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path)
    pending = cache.create("k1", (10, 3))
    pending.array[:5] = 1.0
    pending.abort()
    assert list(tmp_path.iterdir()) == []
    assert cache.load("k1") is None


def test_entries_size_and_clear_touch_only_cache_files(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path)
    cache.store("k1", _array(1), {"representation": "mean_pool", "layer": "layer.0"})
    cache.store("k2", _array(2, (20, 3)), {"representation": "svd_topk", "layer": "layer.1"})
    cache.array_path("k3").write_bytes(b"orphan array without manifest")
    (tmp_path / "notes.txt").write_text("not ours")
    entries = {e.key: e for e in cache.entries()}
    assert set(entries) == {"k1", "k2", "k3"}
    assert entries["k2"].shape == (20, 3) and entries["k2"].description["representation"] == "svd_topk"
    assert entries["k1"].ok and not entries["k3"].ok
    ours = sum(p.stat().st_size for p in tmp_path.iterdir() if p.name != "notes.txt")
    assert cache.size_bytes() == ours
    cleared = cache.clear()
    assert (cleared.removed, cleared.freed, cleared.kept) == (3, ours, [])
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert cache.entries() == [] and cache.size_bytes() == 0


def test_file_fingerprint_is_remembered_and_follows_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = FeatureCache(tmp_path / "cache")
    data = tmp_path / "layers.safetensors"
    data.write_bytes(b"a" * 1000)
    calls: list[Path] = []
    real = feature_cache.file_digest
    monkeypatch.setattr(feature_cache, "file_digest", lambda p: calls.append(p) or real(p))
    monkeypatch.setattr(cache_files, "RECENT_S", 0.0)  # the file was written just now
    first = cache.file_fingerprint(data)
    assert cache.file_fingerprint(data) == first and len(calls) == 1  # second call from the memo
    data.write_bytes(b"b" * 1000)
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))
    assert cache.file_fingerprint(data) != first and len(calls) == 2


def test_a_file_rewritten_in_place_with_its_mtime_restored_gets_a_new_fingerprint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cache_files, "RECENT_S", 0.0)
    cache = FeatureCache(tmp_path / "cache")
    data = tmp_path / "layers.safetensors"
    data.write_bytes(b"a" * 1000)
    first = cache.file_fingerprint(data)
    before = data.stat()
    with data.open("r+b") as f:  # same inode, same size
        f.write(b"b")
    os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (data.stat().st_ino, data.stat().st_size, data.stat().st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )
    assert cache.file_fingerprint(data) != first


def test_a_file_changed_just_now_is_not_remembered(tmp_path: Path) -> None:
    memo = tmp_path / "memo.json"
    data = tmp_path / "layers.safetensors"
    data.write_bytes(b"a" * 1000)
    assert feature_cache.remembered_digest(data, memo) == cache_files.file_digest(data) and not memo.exists()


def test_an_unwritable_memo_is_only_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_files, "RECENT_S", 0.0)
    (tmp_path / "cache").write_text("a file where the cache folder should be")
    data = tmp_path / "layers.safetensors"
    data.write_bytes(b"a" * 1000)
    assert FeatureCache(tmp_path / "cache").file_fingerprint(data) == cache_files.file_digest(data)


def test_default_root_follows_the_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUOPT_TUI_CACHE_DIR", str(tmp_path))
    assert FeatureCache().root == tmp_path / "features"


def _command(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    parser = argparse.ArgumentParser()
    cache_command.configure(parser)
    assert cache_command.run(parser.parse_args(list(argv))) == 0
    return capsys.readouterr().out


def test_cache_command_size_list_clear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GPUOPT_TUI_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "200")
    assert "the feature cache is empty" in _command(capsys, "--list")
    cache = FeatureCache()
    cache.store("a" * 40, _array(), {"representation": "spectrum_stats", "layer": "layer.3", "source": "synthetic"})
    assert "1 entries" in _command(capsys)
    listing = _command(capsys, "--list")
    assert "spectrum_stats" in listing and "layer.3" in listing and "50x7" in listing
    assert "removed 1 entries" in _command(capsys, "--clear")
    assert "0 entries" in _command(capsys, "--size")


def test_cache_command_rejects_two_actions() -> None:
    parser = argparse.ArgumentParser()
    cache_command.configure(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--list", "--clear"])


def test_listing_the_cache_does_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys; from gpuopt_tui.core.caches.features import FeatureCache; "
        "from gpuopt_tui.core.results.ablation import load_results; import gpuopt_tui.commands.cache; "
        "FeatureCache().entries(); print('torch' in sys.modules, 'numpy' in sys.modules)"
    )
    env = {**os.environ, "GPUOPT_TUI_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.split() == ["False", "False"]


def test_clear_leaves_a_write_in_progress_alone(tmp_path) -> None:
    import os
    import time

    from gpuopt_tui.core.caches.features import IN_PROGRESS_S, FeatureCache

    cache = FeatureCache(tmp_path)
    tmp_path.mkdir(exist_ok=True)
    writing = tmp_path / ".entry.npy.tmp"
    writing.write_bytes(b"x" * 10)
    abandoned = tmp_path / ".old.npy.tmp"
    abandoned.write_bytes(b"y" * 10)
    old = time.time() - IN_PROGRESS_S - 60
    os.utime(abandoned, (old, old))
    cache.clear()
    assert writing.exists() and not abandoned.exists()
