"""The attribution texts about a sample (its precision and tolerance, a causal LM's completion) and the run's audit."""

from __future__ import annotations

import dataclasses
import json

from gpuopt_tui.core.results.attribution import Sample, SampleEntry, parse_sample
from gpuopt_tui.core.results.attribution_summary import Audit, AuditedSample, StepStats
from gpuopt_tui.ui.widgets.attribution_text import audit_report, sample_heading, step_report


def entry(full_precision: bool) -> SampleEntry:
    return SampleEntry(
        offset=0, index=7, target=1, label=1, prediction=1, probability=0.9, delta=1e-3, relative_delta=1e-3,
        top_tokens=("good",), search_text="good", steps=33, full_precision=full_precision,
    )  # fmt: skip


def test_a_sample_heading_says_its_steps_ran_in_full_precision() -> None:
    assert "33 steps in full precision" in sample_heading(Sample(entry(True), (), (), False)).plain
    assert "full precision" not in sample_heading(Sample(entry(False), (), (), False)).plain


def test_the_steps_report_carries_the_summary_note() -> None:
    note = "3 of 8 samples ran their steps in tf32, not fp16"
    stats = StepStats("auto", 1e-2, 1025, 200, 25.0, ((9, 5), (33, 3)), 0, None, note)
    assert any(note in line.plain for line in step_report(stats))
    plain = StepStats("auto", 1e-2, 1025, 200, 25.0, ((9, 5), (33, 3)), 0, None)
    assert not any("tf32" in line.plain for line in step_report(plain))


def test_a_sample_above_its_tolerance_says_so_in_its_heading() -> None:
    above = dataclasses.replace(entry(False), within_tolerance=False, error_estimate=0.03)
    assert "above the tolerance" in sample_heading(Sample(above, (), (), False)).plain
    within = dataclasses.replace(above, within_tolerance=True)
    assert "above the tolerance" not in sample_heading(Sample(within, (), (), False)).plain


def test_the_audit_report_names_each_sample_and_the_verdict() -> None:
    samples = (AuditedSample(3, 2e-3, False), AuditedSample(8, 1e-4, True))
    audit = Audit(samples, 2e-3, 1e-3, 1, "strict fp32, the model's own forward, adaptive panels to 0.0001", 1.2, 1)
    text = "\n".join(line.plain for line in audit_report(audit))
    assert "#3 2.0e-03 ⚠" in text and "#8 1.0e-04" in text and "1 of 2 audited samples were reported within" in text
    flagged = "\n".join(line.plain for line in audit_report(dataclasses.replace(audit, silent_misses=0)))
    assert "as the run flags them too" in flagged
    clean = dataclasses.replace(audit, samples=samples[1:], above=0, max_error=1e-4, silent_misses=0)
    assert "every audited sample is within the tolerance 0.001" in "\n".join(x.plain for x in audit_report(clean))


def test_a_causal_lm_sample_heading_names_its_completion_and_log_probability() -> None:
    record = {
        "index": 2, "text": "the cat sat on", "tokens": ["<s>", "the", "cat", "sat", "on"],
        "scores": [0.0, 0.5, -0.25, 0.125, 1.0], "target": 0, "label": None, "prediction": 0,
        "probability": 0.0123, "delta": 1e-4, "relative_delta": 1e-5, "top": [[4, "on", 1.0]],
        "completion": "the mat", "completion_tokens": ["the", "mat"], "logprob": -4.398, "generated": False,
    }  # fmt: skip
    sample = parse_sample(json.dumps(record).encode(), 0)
    heading = sample_heading(sample).plain
    assert "completion 'the mat' · log p -4.4 (p 0.0123)" in heading and "predicted" not in heading
    assert sample.segments[0].text == "the cat sat on" and sample.segments[0].scores[4] == 1.0
    assert "shown:" not in heading  # no per-token rows: nothing to choose


def test_a_per_token_heading_names_the_token_shown_or_why_there_are_none() -> None:
    record = {
        "index": 2, "text": "the cat", "tokens": ["<s>", "the", "cat"], "scores": [0.0, 0.5, 1.0], "target": 0,
        "label": None, "prediction": 0, "probability": 0.25, "delta": 3e-4, "relative_delta": 2e-4,
        "top": [[2, "cat", 1.0]], "completion": "sat down", "completion_tokens": ["sat", "down"], "logprob": -1.386,
        "generated": False, "token_logprobs": [-0.5, -0.886], "token_deltas": [1e-4, 2e-4],
        "token_relative_deltas": [5e-5, 7e-5], "token_top": [[[1, "the", 0.4]], [[2, "cat", 0.6]]],
        "matrix": [[0.0, 0.4, 0.3], [0.0, 0.1, 0.6]],
    }  # fmt: skip
    sample = parse_sample(json.dumps(record).encode(), 0)
    lines = sample_heading(sample).plain.splitlines()
    assert lines[1] == "shown: the whole completion (, . choose: the whole completion or one of its 2 tokens)"
    assert lines[2].startswith("delta 0.0003 = 0.0002 ×")
    lines = sample_heading(sample, 1).plain.splitlines()
    assert lines[0].startswith("sample 2 · completion 'sat down' · log p -1.39")  # the whole completion's
    assert lines[1].startswith("shown: completion token 2 of 2 'down' · log p -0.886 (")
    assert lines[2] == "delta 0.0002 = 7e-05 × |F(x) − F(baseline)|"  # the row's delta; its steps are not recorded
    note = dataclasses.replace(sample, completion_tokens=(), rows_note="its completion tokens' rows take over 4 MiB")
    assert sample_heading(note).plain.splitlines()[1] == "its completion tokens' rows take over 4 MiB"
