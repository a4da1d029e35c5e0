"""The probing engine end to end: it finds the layers that carry the label (synthetic set and demo classifier),
cached, uncached and resumed runs agree, corrupt cache entries are recomputed, and the results read back."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from run_stages import stages
from safetensors.torch import save_file

from gpuopt_tui.core.caches.features import FeatureCache
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.paths import cache_dir
from gpuopt_tui.core.profiles.ablation import BASE_REPRESENTATIONS, AblationProfile
from gpuopt_tui.core.profiles.io import profile_from_data
from gpuopt_tui.core.results.ablation import ALL_LAYERS, TABLE_HEADER, AblationResults, load_results
from gpuopt_tui.core.runs.events import EventWriter, read_events
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.jobs.ablation.features import extract
from gpuopt_tui.jobs.ablation.inputs import synthetic_source
from gpuopt_tui.jobs.ablation.job import probe_tasks, run_job, sample_layers
from gpuopt_tui.jobs.ablation.representations import FeatureSettings
from gpuopt_tui.jobs.ablation.synthetic import SyntheticSpec
from gpuopt_tui.jobs.context import JobCancelled, JobContext

torch.set_num_threads(1)
CPU = torch.device("cpu")
SIGNAL_LAYER = 3
TIMING = ("feature_time_s", "probe_time_s", "cached")


def _profile(device: str = "cpu", **ablation: Any) -> AblationProfile:
    settings = {
        "source": "synthetic",
        "synthetic_samples": 600,
        "synthetic_layers": 6,
        "synthetic_signal_layer": SIGNAL_LAYER,
        "synthetic_rank": 6,
        "synthetic_dim": 24,
        "representations": [
            "svd_topk",
            "spectrum_stats",
            "mean_pool",
            "svd_topk_cumulative",
            "spectrum_stats_all_layers",
        ],
        "hidden_dim": 32,
        "dropout": 0.1,
        "learning_rate": 3e-3,
        "batch_size": 64,
        "max_epochs": 40,
        "patience": 8,
        "quick": True,
        **ablation,
    }
    return profile_from_data({"kind": "ablation", "run": {"device": device}, "ablation": settings}, "test")


def _run(profile: AblationProfile, run_dir: Path, cache_dir: Path, ctx_class: type[JobContext] = JobContext) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    ctx = ctx_class(run_dir, EventWriter(RunDir(run_dir).events), cache_dir)
    try:
        return run_job(profile, ctx)
    finally:
        ctx.events.close()


def _accuracies(results: AblationResults) -> list[dict]:
    return [{k: v for k, v in row.__dict__.items() if k not in TIMING} for row in results.rows]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, AblationResults]:
    root = tmp_path_factory.mktemp("ablation")
    _run(_profile(), root / "run1", root / "cache")
    return root, load_results(root / "run1")


def test_sample_layers_evenly_spaced() -> None:
    assert sample_layers(10, 1.0) == list(range(10))
    assert sample_layers(10, 0.5) == [0, 2, 4, 7, 9]
    quarter = sample_layers(48, 0.25)
    assert len(quarter) == 12 and quarter[0] == 0 and quarter[-1] == 47
    assert {b - a for a, b in itertools.pairwise(quarter)} <= {4, 5}
    assert sample_layers(9, 0.01) == [8]


def test_probe_tasks_per_layer_cumulative_and_all_layers() -> None:
    layers = ["a", "b", "c"]
    tasks = probe_tasks(
        ["mean_pool", "svd_topk_cumulative", "spectrum_stats_all_layers"], layers, {"a": 0, "b": 2, "c": 4}
    )
    assert [(t.representation, t.layer, t.layer_index, t.inputs) for t in tasks] == [
        ("mean_pool", "a", 0, ("a",)),
        ("mean_pool", "b", 2, ("b",)),
        ("mean_pool", "c", 4, ("c",)),
        ("svd_topk_cumulative", "a", 0, ("a",)),
        ("svd_topk_cumulative", "b", 2, ("a", "b")),
        ("svd_topk_cumulative", "c", 4, ("a", "b", "c")),
        ("spectrum_stats_all_layers", ALL_LAYERS, None, ("a", "b", "c")),
    ]


def test_probe_finds_the_layers_that_carry_the_label(first_run: tuple[Path, AblationResults]) -> None:
    _root, results = first_run
    series = results.series("test")
    for name in ("svd_topk", "spectrum_stats"):
        accuracy = {layer: mean for layer, mean, _ in series[name]}
        assert all(accuracy[layer] < 0.7 for layer in range(SIGNAL_LAYER)), (name, accuracy)
        assert all(accuracy[layer] > 0.85 for layer in range(SIGNAL_LAYER, 6)), (name, accuracy)
    mean_pool = {layer: mean for layer, mean, _ in series["mean_pool"]}
    assert max(mean_pool.values()) < 0.7  # the signal lies in the spectrum's shape, not in a direction
    cumulative = {layer: mean for layer, mean, _ in series["svd_topk_cumulative"]}
    assert cumulative[SIGNAL_LAYER - 1] < 0.7 < 0.85 < cumulative[5]
    best = results.best()
    assert best["spectrum_stats_all_layers"].layer == ALL_LAYERS
    assert best["spectrum_stats_all_layers"].test_acc_mean > 0.85
    assert results.chance == pytest.approx(0.5, abs=0.02)


def test_the_layer_is_selected_on_validation_and_tested_once(first_run: tuple[Path, AblationResults]) -> None:
    root, results = first_run
    logs = [e["message"] for e in read_events(root / "run1" / "events.jsonl")[0] if e["type"] == "log"]
    selected = results.best()
    assert set(selected) == set(results.representations)
    for name, row in selected.items():
        rows = [r for r in results.rows if r.representation == name]
        assert row.val_acc_mean == max(r.val_acc_mean for r in rows)
        assert row is next(r for r in rows if r.val_acc_mean == row.val_acc_mean)  # the first one on a tie
        said = f"{name}: layer {row.layer} selected on validation accuracy {row.val_acc_mean:.3f}; its test accuracy"
        assert sum(line.startswith(said) for line in logs) == 1


def test_results_files_and_events(first_run: tuple[Path, AblationResults]) -> None:
    root, results = first_run
    run_dir = root / "run1"
    assert len(results.rows) == 3 * 6 + 6 + 1
    assert results.info["samples"] == 600 and results.info["num_runs"] == 3
    assert results.info["cache"]["misses"] == 3 * 6 and results.info["cache"]["hits"] == 0
    table = results.table()
    assert len(table) == len(results.rows) and len(table[0]) == len(TABLE_HEADER)
    csv_lines = (RunDir(run_dir).results / "results.csv").read_text().splitlines()
    assert len(csv_lines) == 1 + len(results.rows) and csv_lines[0].startswith("representation,layer,layer_index")
    events, corrupt = read_events(RunDir(run_dir).events)
    assert corrupt == 0
    probes = [e for e in events if e["type"] == "metric" and e["name"] == "probe_test_acc"]
    reported = {(e["representation"], e["layer"]): e["value"] for e in probes}
    assert len(probes) == len(reported) == len(results.rows)
    assert reported == {(r.representation, r.layer): r.test_acc_mean for r in results.rows}
    features = [e for e in events if e["type"] == "metric" and e["name"] == "feature_seconds"]
    assert len(features) == 3 * 6 and not any(e["cached"] for e in features)
    progress = [e for e in events if e["type"] == "progress"]
    assert progress[-1]["stage"] == "probes" and progress[-1]["done"] == progress[-1]["total"] == len(results.rows)
    assert sum(e["type"] == "artifact" for e in events) == 2


def test_a_run_reports_each_stage(first_run: tuple[Path, AblationResults]) -> None:
    root, _ = first_run
    assert stages(root / "run1" / "events.jsonl") == [
        "generating the synthetic layers",
        "looking up cached features",
        "features [samples]",
        "probes [probes]",
        "writing results",
        "probes [probes]",  # said again at the end: run lists show the probes
    ]


def test_cached_and_uncached_runs_give_identical_features_and_results(
    first_run: tuple[Path, AblationResults],
) -> None:
    root, results = first_run
    summary = _run(_profile(), root / "run2", root / "cache")
    assert (summary["cache_hits"], summary["cache_misses"]) == (3 * 6, 0)
    cached = load_results(root / "run2")
    assert all(row.cached for row in cached.rows)
    assert _accuracies(cached) == _accuracies(results)
    _run(_profile(use_cache=False), root / "run3", root / "cache")
    uncached = load_results(root / "run3")
    assert not any(row.cached for row in uncached.rows)
    assert _accuracies(uncached) == _accuracies(results)
    assert not (root / "run3" / "state" / "features").exists()  # run-local features are not kept
    # features recomputed from scratch equal the cached arrays bit for bit
    fresh_cache = root / "fresh"
    _run(
        _profile(representations=["svd_topk", "spectrum_stats", "mean_pool"], max_epochs=1), root / "run4", fresh_cache
    )
    shared, fresh = FeatureCache(root / "cache" / "features"), FeatureCache(fresh_cache / "features")
    for entry in fresh.entries():
        assert np.array_equal(fresh.load(entry.key), shared.load(entry.key))
    assert len(fresh.entries()) == 3 * 6


def test_corrupt_cache_entry_is_recomputed(first_run: tuple[Path, AblationResults]) -> None:
    root, results = first_run
    cache = FeatureCache(root / "cache" / "features")
    victim = next(e for e in cache.entries() if e.description["representation"] == "spectrum_stats")
    path = cache.array_path(victim.key)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x55
    path.write_bytes(bytes(raw))
    _run(_profile(), root / "run5", root / "cache")
    again = load_results(root / "run5")
    assert again.info["cache"]["corrupt"] == 1 and again.info["cache"]["misses"] == 1
    assert again.info["cache"]["problems"] == [f"{path}: checksum mismatch"]
    assert _accuracies(again) == _accuracies(results)
    assert cache.load(victim.key) is not None  # stored again, valid


def test_a_cache_that_cannot_be_written_leaves_the_run_going_without_it(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.write_text("a file where the cache folder should be")
    _run(_profile(representations=["mean_pool"], max_epochs=1), tmp_path / "run", cache)
    results = load_results(tmp_path / "run")
    assert results.info["cache"]["enabled"] and not any(row.cached for row in results.rows)
    events, _ = read_events(RunDir(tmp_path / "run").events)
    warnings = [e["message"] for e in events if e["type"] == "warning"]
    assert len(warnings) == 1 and warnings[0].startswith(f"{cache / 'features'}: cannot keep the feature cache")
    assert "use_cache = false" in warnings[0] and cache.read_text().startswith("a file")


class _CancelAfterTwoProbes(JobContext):
    def save_shard(self, name: str, write: Any) -> Path:
        path = super().save_shard(name, write)
        if len(self.finished_shards()) == 2:
            self.request_cancel()
        return path


def test_cancelled_run_resumes_from_finished_probes(tmp_path: Path) -> None:
    profile = _profile(representations=["svd_topk", "mean_pool"], synthetic_samples=300, max_epochs=10)
    with pytest.raises(JobCancelled):
        _run(profile, tmp_path / "run", tmp_path / "cache", _CancelAfterTwoProbes)
    shards = sorted(p.name for p in (tmp_path / "run" / "state").glob("probe-*.json"))
    assert len(shards) >= 2
    before = {name: (tmp_path / "run" / "state" / name).read_text() for name in shards}
    _run(profile, tmp_path / "run", tmp_path / "cache")
    events, _ = read_events(tmp_path / "run" / "events.jsonl")
    assert any("resuming" in e.get("message", "") for e in events if e["type"] == "log")
    assert all((tmp_path / "run" / "state" / name).read_text() == text for name, text in before.items())
    _run(profile, tmp_path / "straight", tmp_path / "cache")
    assert _accuracies(load_results(tmp_path / "run")) == _accuracies(load_results(tmp_path / "straight"))


TWO_WIDTHS = ["mean_pool", "svd_topk"]  # probes of two feature widths train in two groups, cancelled in between


def _model_profile(model: Path, data: Path) -> AblationProfile:
    return profile_from_data(
        {
            "kind": "ablation",
            "run": {"device": "cpu"},
            "model": {"adapter": "hf", "path": str(model)},
            "data": {"source": "jsonl", "path": str(data)},
            "ablation": {"source": "model", "representations": TWO_WIDTHS, "hidden_dim": 8, "max_epochs": 2},
        },
        "test",
    )


def _files_profile(features: Path) -> AblationProfile:
    settings = {"source": "files", "features_path": str(features), "representations": TWO_WIDTHS}
    return profile_from_data(
        {"kind": "ablation", "run": {"device": "cpu"}, "ablation": settings | {"max_epochs": 2}}, "t"
    )


def _write_layers(path: Path, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    layers = {f"layer.{i}": torch.randn(40, 3, 4, generator=gen) for i in range(3)}
    save_file({**layers, "labels": torch.arange(40) % 2}, str(path))


def test_resume_refuses_probes_made_from_other_layers_or_data(
    tmp_path: Path, tiny_bert_dir: Path, tiny_words: list[str]
) -> None:
    """The probes finished before a cancel are not reused once the inputs they came from changed."""
    features = tmp_path / "layers.safetensors"
    _write_layers(features, seed=0)
    data = tmp_path / "data.jsonl"
    texts = [" ".join(tiny_words[i % 7 : i % 7 + 3]) for i in range(40)]
    data.write_text("".join(json.dumps({"text": t, "label": i % 2}) + "\n" for i, t in enumerate(texts)))
    for name, profile, change, refusal in [
        ("files", _files_profile(features), lambda: _write_layers(features, seed=1), "the layers or labels"),
        (
            "model",
            _model_profile(tiny_bert_dir, data),
            lambda: data.write_text(data.read_text().replace('"text": "', '"text": "the ')),
            "the data",
        ),
    ]:
        run_dir = tmp_path / name
        with pytest.raises(JobCancelled):
            _run(profile, run_dir, tmp_path / "cache", _CancelAfterFirstProbe)
        change()
        with pytest.raises(UserError, match=rf"^resume refused: {refusal} changed since the run started \(.+\)"):
            _run(profile, run_dir, tmp_path / "cache")
        assert not (run_dir / "results" / "results.json").exists()


class _CancelAfterFirstProbe(JobContext):
    def save_shard(self, name: str, write: Any) -> Path:
        path = super().save_shard(name, write)
        self.request_cancel()
        return path


def test_layer_sampling_probes_only_the_chosen_layers(tmp_path: Path) -> None:
    profile = _profile(representations=["spectrum_stats"], layer_fraction=0.5, max_epochs=5)
    _run(profile, tmp_path / "run", tmp_path / "cache")
    results = load_results(tmp_path / "run")
    assert [row.layer for row in results.rows] == ["layer.0", "layer.2", "layer.5"]
    assert results.info["layers"] == [row.layer for row in results.rows]


def test_results_reader_errors(tmp_path: Path) -> None:
    from gpuopt_tui.core.errors import UserError

    with pytest.raises(UserError, match="no results.json"):
        load_results(tmp_path)
    (tmp_path / "results.json").write_text(json.dumps({"format": 1, "rows": [{"representation": "x"}]}))
    with pytest.raises(UserError, match=r"rows\[0\] is incomplete"):
        load_results(tmp_path)


@pytest.mark.slow
def test_demo_classifier_probe_finds_the_attention_layers(tmp_path: Path, demo_classifier: Any) -> None:
    """The demo's label is which opinion word comes first: invisible to a bag of embeddings, mixed in by
    attention. Probes on the embedding output stay near chance; the first block's output is clearly above it and
    the deeper blocks' outputs are high."""
    profile = profile_from_data(
        {
            "kind": "ablation",
            "run": {"device": "cpu"},
            "model": {"adapter": "demo"},
            "data": {"source": "demo", "split": "train"},
            "ablation": {
                "n_samples": 800,
                "representations": ["mean_pool", "last_token"],
                "hidden_dim": 32,
                "dropout": 0.1,
                "max_epochs": 30,
                "quick": True,
            },
        },
        "test",
    )
    _run(profile, tmp_path / "run", cache_dir())  # the session's cache, where demo_classifier was trained
    results = load_results(tmp_path / "run")
    assert results.info["layers"] == ["embeddings", "layer.1", "layer.2", "layer.3", "layer.4"]
    for name, points in results.series().items():
        accuracy = [mean for _, mean, _ in points]
        assert accuracy[0] < 0.7, (name, accuracy)
        assert accuracy[1] > accuracy[0] + 0.1, (name, accuracy)
        assert min(accuracy[2:]) > 0.8, (name, accuracy)


@pytest.mark.gpu
def test_gpu_features_match_the_cpu_and_bf16_probes_find_the_signal(tmp_path: Path) -> None:
    cuda = torch.device("cuda")
    source = synthetic_source(SyntheticSpec(samples=400, layers=4, signal_layer=2, rank=6, dim=24))
    settings = FeatureSettings()
    on_gpu = extract(source, BASE_REPRESENTATIONS, source.layers, settings, FeatureCache(tmp_path / "g"), cuda, 64)
    on_cpu = extract(source, BASE_REPRESENTATIONS, source.layers, settings, FeatureCache(tmp_path / "c"), CPU, 64)
    for key, item in on_gpu.items():
        np.testing.assert_allclose(item.array, on_cpu[key].array, rtol=1e-3, atol=1e-4)
    _run(_profile(device="cuda", representations=["spectrum_stats"]), tmp_path / "run", tmp_path / "cache")
    results = load_results(tmp_path / "run")
    assert results.info["precision"] == "bf16"
    accuracy = {layer: mean for layer, mean, _ in results.series()["spectrum_stats"]}
    assert max(accuracy[layer] for layer in range(SIGNAL_LAYER)) < 0.7
    assert min(accuracy[layer] for layer in range(SIGNAL_LAYER, 6)) > 0.85
