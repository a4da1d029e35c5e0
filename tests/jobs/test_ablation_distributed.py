"""The probing engine over several processes: the batches split between them, feature extraction over
threads standing in for processes (stored tensors and a model), and a 2-process gloo run through the real
launcher, resumed from probe shards, whose results equal a one-process run."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch

from gpuopt_tui.core.caches.features import FeatureCache
from gpuopt_tui.core.profiles.ablation import AblationProfile
from gpuopt_tui.core.profiles.io import profile_from_data
from gpuopt_tui.core.results.ablation import TABLE_HEADER, load_results
from gpuopt_tui.core.runs.events import EventWriter, read_events
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.lifecycle import create_run, launch, wait_for
from gpuopt_tui.jobs.ablation.features import BatchShares, LayerFeatures, extract
from gpuopt_tui.jobs.ablation.inputs import LayerSource, synthetic_source
from gpuopt_tui.jobs.ablation.job import run_job
from gpuopt_tui.jobs.ablation.representations import FeatureSettings
from gpuopt_tui.jobs.ablation.synthetic import SyntheticSpec
from gpuopt_tui.jobs.context import CHECKSUMS, Collective, JobContext

torch.set_num_threads(1)
CPU = torch.device("cpu")
T = TypeVar("T")
BASES = ["svd_topk", "spectrum_stats", "mean_pool", "random_projection"]
SETTINGS = FeatureSettings(top_k=3, projection_dim=4)
TIMING = ("feature_time_s", "probe_time_s", "cached")


class ThreadCollective(Collective):
    """The collective of `world_size` threads of one process (a stand-in for torch.distributed)."""

    def __init__(self, rank: int, world_size: int, barrier: threading.Barrier, slots: list[Any]) -> None:
        self.rank, self.world_size, self._barrier, self._slots = rank, world_size, barrier, slots

    def barrier(self) -> None:
        self._barrier.wait(timeout=60)

    def gather(self, obj: T) -> list[T] | None:
        self._slots[self.rank] = obj
        self.barrier()
        out = list(self._slots) if self.rank == 0 else None
        self.barrier()
        return out

    def broadcast(self, obj: T) -> T:
        if self.rank == 0:
            self._slots[0] = obj
        self.barrier()
        value = self._slots[0]
        self.barrier()
        return value


def _extract_on_threads(
    source: LayerSource, store_root: Path, parts: Path, world_size: int, batch_size: int
) -> tuple[list[dict[tuple[str, str], LayerFeatures]], list[FeatureCache], list[list[tuple[int, int]]]]:
    """extract() on `world_size` threads: each one's features, cache (for its stats) and progress calls."""
    barrier, slots = threading.Barrier(world_size), [None] * world_size
    features: list[Any] = [None] * world_size
    stores = [FeatureCache(store_root) for _ in range(world_size)]
    progress: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            features[r] = extract(
                source,
                BASES,
                source.layers,
                SETTINGS,
                stores[r],
                CPU,
                batch_size,
                lambda done, total: progress[r].append((done, total)),
                dist=ThreadCollective(r, world_size, barrier, slots),
                parts=parts,
            )
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return features, stores, progress


def _same_features(got: dict[tuple[str, str], LayerFeatures], want: dict[tuple[str, str], LayerFeatures]) -> None:
    assert got.keys() == want.keys()
    for key, item in got.items():
        assert item.array is not None and np.array_equal(item.array, want[key].array), key


# --- the split --------------------------------------------------------------------------------------------------
def test_batch_shares_give_every_batch_to_one_process_balanced_by_cost() -> None:
    source = synthetic_source(SyntheticSpec(samples=45, layers=2, signal_layer=1, rank=2, dim=4))
    for world_size in (1, 2, 3, 7, 8):
        shares = BatchShares.of(source, 8, world_size)
        assert shares.bounds == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 40), (40, 45)]
        batches = [shares.batches(rank) for rank in range(world_size)]
        assert sorted(j for mine in batches for j in mine) == list(range(6))  # each batch once
        assert sum(shares.rows(rank) for rank in range(world_size)) == 45
        loads = [shares.rows(rank) for rank in range(world_size)]
        assert max(loads) - min(loads) <= 8  # within one batch of each other
    assert BatchShares.of(source, 8, 2).batches(0) == [0, 2, 4] and BatchShares.of(source, 8, 2).rows(1) == 21
    assert [len(BatchShares.of(source, 8, 8).batches(rank)) for rank in range(8)] == [1] * 6 + [0, 0]


def test_model_batches_are_weighted_by_their_padded_tokens(
    tiny_bert_dir: Path, tiny_words: list[str], tmp_path: Path
) -> None:
    source = _model_source(tiny_bert_dir, tiny_words, tmp_path, lengths=[2, 2, 2, 2, 11, 11, 11, 11, 3, 3, 3, 3])
    lengths = source.dataset.lengths().tolist()
    assert source.batch_costs(4) == [4.0 * max(lengths[i : i + 4]) for i in (0, 4, 8)]
    shares = BatchShares.of(source, 4, 2)
    assert shares.batches(0) == [1] and shares.batches(1) == [0, 2]  # the long batch alone


# --- extraction split by sample -----------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_threads_extract_the_features_of_one_process(tmp_path: Path, world_size: int) -> None:
    """Uneven batches (20 samples in batches of 8; with 4 processes one has none) and a cache that already holds
    some entries: the same arrays bit for bit, each lookup counted once, progress over each process's share."""
    source = synthetic_source(SyntheticSpec(samples=20, layers=3, signal_layer=1, rank=3, dim=6))
    alone = extract(source, BASES, source.layers, SETTINGS, FeatureCache(tmp_path / "alone"), CPU, 8)
    half = FeatureCache(tmp_path / "shared")
    extract(source, BASES[:2], source.layers[:2], SETTINGS, half, CPU, 8)  # 4 of the 12 entries cached
    parts = tmp_path / "parts"
    features, stores, progress = _extract_on_threads(source, tmp_path / "shared", parts, world_size, 8)
    for got in features:
        _same_features(got, alone)
        assert [item.cached for item in got.values()] == [item.cached for item in features[0].values()]
        assert sum(item.cached for item in got.values()) == 4
        assert {item.owner for item in got.values()} == set(range(world_size))
    assert sum(s.stats.hits for s in stores) == 4 and sum(s.stats.misses for s in stores) == 8
    shares = BatchShares.of(source, 8, world_size)
    for rank, calls in enumerate(progress):
        rows = shares.rows(rank)
        assert all(total == rows for _, total in calls) and calls[-1:] == ([(rows, rows)] if rows else [])
    assert not parts.exists()
    again, stores, _ = _extract_on_threads(source, tmp_path / "shared", parts, world_size, 8)
    assert all(item.cached for item in again[1].values())
    assert sum(s.stats.hits for s in stores) == 12 and sum(s.stats.misses for s in stores) == 0


def test_threads_split_a_models_forward_passes_by_sample(
    tiny_bert_dir: Path, tiny_words: list[str], tmp_path: Path
) -> None:
    source = _model_source(tiny_bert_dir, tiny_words, tmp_path, lengths=[3, 9, 2, 5, 11, 4, 6, 2, 8, 3])
    alone = extract(source, BASES, source.layers, SETTINGS, FeatureCache(tmp_path / "alone"), CPU, 3)
    features, _, progress = _extract_on_threads(source, tmp_path / "cache", tmp_path / "parts", 2, 3)
    _same_features(features[1], alone)
    assert sum(calls[-1][1] for calls in progress) == source.samples


def _model_source(tiny_bert_dir: Path, words: list[str], tmp_path: Path, lengths: list[int]) -> Any:
    """A model source over the tiny BERT with one text of each length (in words)."""
    from gpuopt_tui.jobs.ablation.inputs import model_source

    data = tmp_path / "probe.jsonl"
    data.write_text(
        "".join(json.dumps({"text": " ".join(words[:n]), "label": i % 2}) + "\n" for i, n in enumerate(lengths))
    )
    profile = profile_from_data(
        {
            "kind": "ablation",
            "model": {"adapter": "hf", "path": str(tiny_bert_dir)},
            "data": {"source": "jsonl", "path": str(data)},
        },
        "test",
    )
    return model_source(profile, CPU, tmp_path / "models")


# --- the whole run over two processes -------------------------------------------------------------------------
def _profile(devices: str = "1", **ablation: Any) -> AblationProfile:
    settings = {
        "source": "synthetic",
        "synthetic_samples": 240,
        "synthetic_layers": 4,
        "synthetic_signal_layer": 2,
        "synthetic_rank": 4,
        "synthetic_dim": 12,
        "representations": ["svd_topk", "spectrum_stats", "mean_pool", "svd_topk_cumulative"],
        "extract_batch_size": 32,
        "hidden_dim": 16,
        "dropout": 0.1,  # masks per probe seed: the same whichever process trains a probe
        "batch_size": 64,
        "max_epochs": 12,
        "patience": 4,
        "quick": True,
        **ablation,
    }
    data = {"kind": "ablation", "run": {"device": "cpu", "devices": devices}, "ablation": settings}
    return profile_from_data(data, "test")


def _run_here(profile: AblationProfile, run_dir: Path, cache: Path) -> dict[str, Any]:
    run_dir.mkdir(parents=True)
    ctx = JobContext(run_dir, EventWriter(RunDir(run_dir).events), cache)
    try:
        return run_job(profile, ctx)
    finally:
        ctx.events.close()


def _without_timing(rows: list[Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.__dict__.items() if k not in TIMING} for row in rows]


def test_two_processes_resume_and_match_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUOPT_TUI_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GPUOPT_TUI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    _run_here(_profile(), tmp_path / "alone", tmp_path / "alone-cache")
    one = load_results(tmp_path / "alone")
    # the shared cache already holds svd_topk's 4 entries; the first 3 probes were done by an earlier attempt
    _run_here(_profile(representations=["svd_topk"], max_epochs=1), tmp_path / "warm", tmp_path / "cache")
    run_dir = create_run(_profile(devices="2"), root=tmp_path / "home" / "runs")
    earlier = sorted((tmp_path / "alone" / "state").glob("probe-mean_pool-*.json"))[:3]
    (RunDir(run_dir).state / CHECKSUMS).mkdir()
    for shard in earlier:  # as an earlier attempt left them: each with its checksum file
        shutil.copy2(shard, RunDir(run_dir).state / shard.name)
        shutil.copy2(shard.parent / CHECKSUMS / f"{shard.name}.json", RunDir(run_dir).state / CHECKSUMS)
    launch(run_dir)
    info = wait_for(run_dir, frozenset({"finished", "failed", "cancelled", "crashed"}), timeout=120)
    assert info.status == "finished", RunDir(run_dir).log.read_text()[-3000:]

    two = load_results(run_dir)
    assert _without_timing(two.rows) == _without_timing(one.rows)
    assert len(two.table()[0]) == len(TABLE_HEADER)
    assert {k: v for k, v in two.info.items() if k != "cache"} == {k: v for k, v in one.info.items() if k != "cache"}
    assert two.info["cache"] == {"hits": 4, "misses": 8, "corrupt": 0, "problems": [], "enabled": True}
    assert info.summary["cache_hits"] == 4 and info.summary["probes"] == len(one.rows) == 16
    assert not (RunDir(run_dir).state / "feature-parts").exists()
    for shard in earlier:  # kept, not trained again
        assert (RunDir(run_dir).state / shard.name).stat().st_mtime == shard.stat().st_mtime

    events, corrupt = read_events(RunDir(run_dir).events)
    assert corrupt == 0
    metrics = [e for e in events if e["type"] == "metric"]
    probes = [e for e in metrics if e["name"] == "probe_test_acc"]
    assert {e["rank"] for e in probes} == {0, 1} and len(probes) == 16 - 3
    resumed = {shard.name for shard in earlier}
    assert {(e["representation"], e["layer"]): e["value"] for e in probes} == {
        (r.representation, r.layer): r.test_acc_mean
        for r in two.rows
        if f"probe-{r.representation}-{r.layer}.json" not in resumed
    }
    feature_seconds = [e for e in metrics if e["name"] == "feature_seconds"]
    assert {e["rank"] for e in feature_seconds} == {0, 1} and len(feature_seconds) == 12
    assert [(e["rank"], e["value"]) for e in metrics if e["name"] == "feature_cache_hits"] == [(0, 4)]
    last: dict[tuple[int, str], dict[str, Any]] = {}
    for e in events:
        if e["type"] == "progress":
            last[e["rank"], e["stage"]] = e
    features = [last[rank, "features"] for rank in (0, 1)]
    assert [p["done"] for p in features] == [p["total"] for p in features] and sum(p["total"] for p in features) == 240
    probes_progress = [last[rank, "probes"] for rank in (0, 1)]
    assert all(p["done"] == p["total"] for p in probes_progress)
    assert sum(p["total"] for p in probes_progress) == 16  # rank 0's total holds the 3 done before
    assert any("resuming: 3 of 16" in e.get("message", "") for e in events if e["type"] == "log")
