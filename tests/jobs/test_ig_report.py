"""The attribution run's report (report.py): the summary and records of a collected result, without files."""

from __future__ import annotations

import torch

from gpuopt_tui.core.profiles.attribution import AttributionSection
from gpuopt_tui.jobs.attribution.engine import Settings
from gpuopt_tui.jobs.attribution.outputs import Collected
from gpuopt_tui.jobs.attribution.report import FILE_NAMES, Results, build_report
from gpuopt_tui.jobs.models import Adapter

CPU = torch.device("cpu")


def collected_of(adapter: Adapter, n: int, steps: list[int], within: list[bool] | None, low: list[bool]):
    ds = adapter.builtin_dataset("test").head(n)
    mask = ds.tensors["attention_mask"]
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(mask.shape, generator=generator) * mask
    total = scores.sum(-1)
    collected = Collected(
        input_ids=ds.tensors["input_ids"],
        attention_mask=mask,
        token_scores=scores,
        deltas=torch.full((n,), 1e-4),
        relative_deltas=torch.full((n,), 1e-4) / total,
        scores=total + 1e-4,
        baseline_scores=torch.zeros(n),
        target=torch.zeros(n, dtype=torch.long),
        prediction=torch.zeros(n, dtype=torch.long),
        probability=torch.full((n,), 0.9),
        margin=torch.ones(n),
        low_margin=torch.tensor(low),
        steps=torch.tensor(steps),
        fallback=torch.zeros(n, dtype=torch.int8),
        error=torch.full((n,), 1e-3),
        within=None if within is None else torch.tensor(within),
        labels=ds.labels,
    )
    return ds, collected


def report_of(adapter: Adapter, section: AttributionSection, steps, within, low):
    ds, collected = collected_of(adapter, len(steps), steps, within, low)
    settings = Settings.resolve(section, adapter, CPU, len(ds))
    results = Results(section, settings, 2.0, None, {"samples": len(ds), "seconds": 1.0}, None, None)
    return build_report(adapter, ds, collected, results, processes=1)


def test_auto_steps_report_the_engine_verdicts_and_the_close_margins(demo_classifier: Adapter) -> None:
    section = AttributionSection(n_steps="auto", tolerance=1e-2, batch_size=3, use_amp=False, compile="off")
    report = report_of(demo_classifier, section, [17, 1025, 33, 17], [True, False, True, True], [0, 0, 1, 0])
    summary = report.summary
    assert summary["steps"]["above_tolerance"] == 1 and summary["steps"]["above_tolerance_samples"] == [1]
    assert summary["steps"]["histogram"] == [[17, 2], [33, 1], [1025, 1]]
    assert report.outcome["n_samples"] == 4 and report.outcome["samples_per_s"] == 2.0
    assert summary["timing"]["attempt_samples_per_s"] == 4.0 and summary["timing"]["processes"] == 1
    assert summary["settings"]["batch_size"] == 3 and summary["settings"]["device"] == "cpu"
    assert summary["settings"]["n_steps"] == "auto" and summary["low_margin"]["count"] == 1
    engine = {"n_steps", "method", "tolerance", "max_steps", "precision", "cast_weights", "full_precision_fallback"}
    engine |= {"target", "baseline", "baseline_token", "optimized", "alpha_batch_size", "memory_fraction", "compile"}
    output = {"device", "batch_size", "length_bucketing", "top_k", "top_k_sample", "min_token_count"}
    assert set(summary["settings"]) == engine | output  # flat, as runs have always written it
    assert summary["files"] == FILE_NAMES and summary["audit"] is None and "completions" not in summary
    warnings = [text for kind, text in report.messages if kind == "warn"]
    assert summary["steps"]["warning"] in warnings
    assert any(text.startswith("1 samples have their two largest outputs") for text in warnings)
    records = list(report.records)
    assert [r["text"] for r in records] == demo_classifier.builtin_dataset("test").head(4).texts


def test_fixed_steps_have_no_verdicts_and_no_warnings(demo_classifier: Adapter) -> None:
    section = AttributionSection(n_steps=8, use_amp=False, compile="off")
    report = report_of(demo_classifier, section, [8, 8, 8], None, [0, 0, 0])
    assert report.summary["steps"]["mode"] == "fixed" and report.summary["steps"]["above_tolerance"] is None
    assert report.messages == []
    assert [entry["token"] for entry in report.summary["top_k"][:5]] == report.outcome["top_tokens"]
