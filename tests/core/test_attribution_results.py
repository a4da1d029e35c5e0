"""The torch-free reader of an attribution run's result files, on files written by the real engine (the demo
classifier and the demo two-tower recommender): the index against the lines themselves, reading on demand,
paging, search, corrupt lines, a file that changed, summary.json and check.json."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.paths import cache_dir
from gpuopt_tui.core.profiles.io import find_profile, load_profile
from gpuopt_tui.core.results.attribution import JSONL_NAME, TENSORS_NAME, SampleIndex, load_run_files, page, page_count
from gpuopt_tui.core.results.attribution_query import SampleQuery, select
from gpuopt_tui.core.results.attribution_summary import CHECK_NAME, SUMMARY_NAME, load_check, load_summary
from gpuopt_tui.core.runs.events import EventWriter
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.lifecycle import create_run


def engine_run(root: Path, profile_name: str, *overrides: str) -> Path:
    """A run directory made by create_run and filled by the real attribution engine, in this process."""
    from gpuopt_tui.jobs.attribution.job import run_job
    from gpuopt_tui.jobs.context import JobContext

    path = find_profile(profile_name)
    profile = load_profile(path, ["run.device=cpu", *overrides])
    run_dir = create_run(profile, source=path, root=root)
    events = EventWriter(RunDir(run_dir).events)
    try:
        run_job(profile, JobContext(run_dir, events, cache_dir()))
    finally:
        events.close()
    return run_dir


@pytest.fixture(scope="module")
def classifier_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    settings = ("n_samples=12", "n_steps=8", "batch_size=5", "top_k_sample=3", "check_samples=3")
    return engine_run(tmp_path_factory.mktemp("runs"), "demo-attribution", *(f"attribution.{s}" for s in settings))


@pytest.fixture(scope="module")
def two_tower_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    settings = ("n_samples=5", "n_steps=8", "batch_size=2", "top_k_sample=4")
    return engine_run(
        tmp_path_factory.mktemp("runs"), "demo-attribution-two-tower", *(f"attribution.{s}" for s in settings)
    )


def lines_of(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lines_of(RunDir(run_dir).results / JSONL_NAME)]


def test_the_index_holds_every_line_and_reads_each_on_demand(classifier_run: Path) -> None:
    path = RunDir(classifier_run).results / JSONL_NAME
    index = SampleIndex.build(path)
    assert index is not None and index.corrupt == 0
    expected = records(classifier_run)
    assert len(index) == len(expected) == 12
    offsets = [0]
    for line in lines_of(path)[:-1]:
        offsets.append(offsets[-1] + len(line))
    assert [e.offset for e in index.entries] == offsets
    for entry, record in zip(index.entries, expected):
        assert (entry.index, entry.target, entry.prediction, entry.label) == (
            record["index"],
            record["target"],
            record["prediction"],
            record["label"],
        )
        assert entry.probability == record["probability"]
        assert entry.relative_delta == record["relative_delta"]
        assert entry.top_tokens == tuple(t[1] for t in record["top"])
        assert entry.search_text == record["text"].lower()
    order = list(range(len(index)))
    random.Random(0).shuffle(order)
    for i in order:  # read in any order, each from its own offset
        sample = index.read(index.entries[i])
        record = expected[i]
        assert not sample.two_tower and len(sample.segments) == 1
        assert list(sample.segments[0].tokens) == record["tokens"]
        assert list(sample.segments[0].scores) == record["scores"]
        assert [(t.position, t.token, t.score) for t in sample.top] == [((p,), t, s) for p, t, s in record["top"]]
        assert sample.max_abs == max(abs(s) for s in record["scores"])


def test_two_tower_lines_keep_one_segment_per_candidate(two_tower_run: Path) -> None:
    index = SampleIndex.build(RunDir(two_tower_run).results / JSONL_NAME)
    assert index is not None and len(index) == 5
    for entry, record in zip(index.entries, records(two_tower_run)):
        sample = index.read(entry)
        assert sample.two_tower
        assert [s.text for s in sample.segments] == record["text"]
        assert [list(s.tokens) for s in sample.segments] == record["tokens"]
        assert [list(s.scores) for s in sample.segments] == record["scores"]
        assert [(list(t.position), t.token) for t in sample.top] == [(p, t) for p, t, _ in record["top"]]
        assert entry.search_text == " | ".join(record["text"]).lower()
        # only the explained candidate has attributions
        assert any(s != 0 for s in sample.segments[record["target"]].scores)


def test_pages_cover_every_row_once(classifier_run: Path, tmp_path: Path) -> None:
    """A file of 1,203 lines (the engine's lines repeated with new indices) read a page at a time."""
    lines = [json.loads(line) for line in lines_of(RunDir(classifier_run).results / JSONL_NAME)]
    big = tmp_path / JSONL_NAME
    with big.open("w", encoding="utf-8") as f:
        for i in range(1203):
            f.write(json.dumps({**lines[i % len(lines)], "index": i}, ensure_ascii=False) + "\n")
    index = SampleIndex.build(big)
    assert index is not None and len(index) == 1203
    rows = list(index.entries)
    assert page_count(rows, 500) == 3 and page_count([], 500) == 1
    pages = [page(rows, n, 500) for n in range(3)]
    assert [len(p) for p in pages] == [500, 500, 203]
    assert [e.index for p in pages for e in p] == list(range(1203))
    assert page(rows, 3, 500) == []
    for entry in (pages[0][0], pages[1][499], pages[2][202]):
        assert index.read(entry).entry == entry


def test_corrupt_lines_are_skipped_and_counted(classifier_run: Path, tmp_path: Path) -> None:
    lines = lines_of(RunDir(classifier_run).results / JSONL_NAME)
    damaged = tmp_path / JSONL_NAME
    half = lines[2][: len(lines[2]) // 2] + b"\n"
    missing = json.dumps({"index": 99, "text": "no scores"}).encode() + b"\n"
    damaged.write_bytes(b"".join([lines[0], b"not json\n", half, b"\n", lines[1], missing, *lines[3:]]))
    index = SampleIndex.build(damaged)
    assert index is not None
    assert index.corrupt == 3
    assert [e.index for e in index.entries] == [0, 1, *range(3, 12)]
    assert list(index.read(index.entries[-1]).segments[0].scores) == json.loads(lines[-1])["scores"]


def test_lines_in_another_layout_are_read_whole(classifier_run: Path, tmp_path: Path) -> None:
    """The index skips parsing tokens and scores only in the engine's own layout; other lines are parsed whole."""
    expected = records(classifier_run)
    other = tmp_path / JSONL_NAME
    other.write_text(
        "".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in expected), encoding="utf-8"
    )
    index = SampleIndex.build(other)
    reference = SampleIndex.build(RunDir(classifier_run).results / JSONL_NAME)
    assert index is not None and reference is not None and index.corrupt == 0
    fields = [(e.index, e.target, e.probability, e.relative_delta, e.top_tokens, e.search_text) for e in index.entries]
    assert fields == [
        (e.index, e.target, e.probability, e.relative_delta, e.top_tokens, e.search_text) for e in reference.entries
    ]
    assert index.read(index.entries[4]).segments == reference.read(reference.entries[4]).segments


def test_a_file_replaced_after_indexing_is_not_misread(classifier_run: Path, tmp_path: Path) -> None:
    path = tmp_path / JSONL_NAME
    shutil.copy(RunDir(classifier_run).results / JSONL_NAME, path)
    index = SampleIndex.build(path)
    assert index is not None
    tmp = tmp_path / "new.jsonl"
    tmp.write_bytes(b"".join(reversed(lines_of(path))))
    tmp.replace(path)  # as a resumed run writes it: a new file renamed over the old one
    with pytest.raises(UserError, match="changed since it was read"):
        index.read(index.entries[3])
    path.unlink()
    with pytest.raises(UserError, match="changed since it was read"):
        index.read(index.entries[3])


def test_indexing_stops_when_cancelled(classifier_run: Path) -> None:
    assert SampleIndex.build(RunDir(classifier_run).results / JSONL_NAME, lambda: True) is None
    assert load_run_files(classifier_run, lambda: True) is None


def test_search_and_order(classifier_run: Path) -> None:
    index = SampleIndex.build(RunDir(classifier_run).results / JSONL_NAME)
    assert index is not None
    expected = records(classifier_run)

    def found(query: str, sort: str = "index") -> list[int]:
        return [e.index for e in select(index.entries, SampleQuery.parse(query), sort)]

    word = expected[0]["text"].split()[0]
    assert found(word) == [r["index"] for r in expected if word in r["text"].lower()]
    assert found(word.upper()) == found(word)
    top = expected[1]["top"][0][1]
    assert found(f"top:{top}") == [r["index"] for r in expected if top in [t[1] for t in r["top"]]]
    assert found("pred:1 label:1") == [r["index"] for r in expected if r["prediction"] == r["label"] == 1]
    assert found("target:0") == [r["index"] for r in expected if r["target"] == 0]
    assert found("wrong") == [r["index"] for r in expected if r["prediction"] != r["label"]]
    assert found("") == list(range(12))
    assert found("", "delta") == [r["index"] for r in sorted(expected, key=lambda r: -r["relative_delta"])]
    assert found("", "probability") == [r["index"] for r in sorted(expected, key=lambda r: r["probability"])]
    for bad in ("pred:x", "colour:red", "top:"):
        with pytest.raises(UserError, match=bad):
            SampleQuery.parse(bad)


def test_summary_and_check_as_written(classifier_run: Path) -> None:
    results = RunDir(classifier_run).results
    raw = json.loads((results / SUMMARY_NAME).read_text())
    summary = load_summary(results)
    assert summary is not None
    assert summary.n_samples == raw["n_samples"] == 12
    assert [(t.token, t.mean_share, t.mean, t.count) for t in summary.top_k] == [
        (t["token"], t["mean_share"], t["mean"], t["count"]) for t in raw["top_k"]
    ]
    assert summary.deltas.median_rel == raw["deltas"]["median_rel"]
    assert summary.deltas.p95_rel == raw["deltas"]["p95_rel"]
    assert summary.deltas.suggested_n_steps == raw["deltas"]["suggested_n_steps"]
    assert summary.settings["n_steps"] == 8
    raw_check = json.loads((results / CHECK_NAME).read_text())
    check = load_check(results)
    assert check is not None
    assert check.n_samples == raw_check["n_samples"] == 3
    assert check.max_rel_diff == raw_check["max_rel_diff"]
    assert check.median_rel_diff == raw_check["median_rel_diff"]
    assert check.precision_original == "fp32"
    assert check.max_rel_diff < 1e-4  # fp32 on the CPU: both paths agree closely


def test_unreadable_or_missing_files(two_tower_run: Path, tmp_path: Path) -> None:
    assert load_check(RunDir(two_tower_run).results) is None  # this run has no check
    assert load_summary(tmp_path) is None
    (tmp_path / SUMMARY_NAME).write_text('{"n_samples": 3')
    with pytest.raises(UserError, match=f"{SUMMARY_NAME}: not a readable JSON file"):
        load_summary(tmp_path)
    (tmp_path / CHECK_NAME).write_text('{"n_samples": 3}')
    with pytest.raises(UserError, match=f"{CHECK_NAME}: not a check result"):
        load_check(tmp_path)


def test_everything_a_run_has(classifier_run: Path, two_tower_run: Path) -> None:
    files = load_run_files(classifier_run)
    assert files is not None and files.has_results and not files.errors
    assert files.summary is not None and files.check is not None and files.samples is not None
    assert files.check_samples == 3  # from the run's frozen profile.toml
    results = RunDir(classifier_run).results
    assert [(f.name, f.path, f.size) for f in files.exports] == [
        (name, results / name, (results / name).stat().st_size)
        for name in (JSONL_NAME, TENSORS_NAME, SUMMARY_NAME, CHECK_NAME)
    ]
    other = load_run_files(two_tower_run)
    assert other is not None and other.check is None and other.check_samples == 0
    assert [f.name for f in other.exports] == [JSONL_NAME, TENSORS_NAME, SUMMARY_NAME]


def test_auto_steps_and_margins_as_written(tmp_path: Path) -> None:
    settings = ("n_samples=6", 'n_steps="auto"', "tolerance=0.001", "max_steps=33", "batch_size=3")
    run_dir = engine_run(tmp_path, "demo-attribution", *(f"attribution.{s}" for s in settings))
    raw = json.loads((RunDir(run_dir).results / SUMMARY_NAME).read_text())
    summary = load_summary(RunDir(run_dir).results)
    assert summary is not None and summary.steps is not None and summary.low_margin is not None
    assert summary.steps.mode == "auto" and summary.steps.tolerance == 0.001 and summary.steps.max_steps == 33
    assert summary.steps.histogram == tuple(map(tuple, raw["steps"]["histogram"]))
    assert summary.low_margin.count == raw["low_margin"]["count"] and summary.low_margin.precision == "fp32"
    index = SampleIndex.build(RunDir(run_dir).results / JSONL_NAME)
    assert index is not None
    lines = records(run_dir)
    assert [e.steps for e in index.entries] == [r["steps"] for r in lines]
    assert [e.margin for e in index.entries] == [r["margin"] for r in lines]
    assert sum(count for _, count in summary.steps.histogram) == 6 and summary.steps.total == sum(
        r["steps"] for r in lines
    )
    assert select(index.entries, SampleQuery.parse("lowmargin")) == [e for e in index.entries if e.low_margin]


def test_full_precision_samples_are_read_searched_and_summarised(tmp_path: Path) -> None:
    """What a GPU run with the full-precision fallback writes (on the CPU no sample needs it): the per-sample flag
    and the summary's note, as the sample list and the Summary tab read them."""
    settings = ("n_samples=4", 'n_steps="auto"', "max_steps=33", "batch_size=4")
    results = RunDir(engine_run(tmp_path, "demo-attribution", *(f"attribution.{s}" for s in settings))).results
    lines = records(results.parent)
    assert all(r["full_precision"] is False for r in lines)  # written for every sample, false on the CPU
    assert all(isinstance(r["within_tolerance"], bool) and r["error_estimate"] >= 0 for r in lines)
    lines[1]["full_precision"] = lines[3]["full_precision"] = True
    for i, line in enumerate(lines):
        line["within_tolerance"] = i != 0
    (results / JSONL_NAME).write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")
    raw = json.loads((results / SUMMARY_NAME).read_text())
    assert raw["steps"]["full_precision"] is None
    raw["steps"]["full_precision"] = {"samples": 2, "precision": "tf32", "note": "2 of 4 samples ran in tf32"}
    (results / SUMMARY_NAME).write_text(json.dumps(raw), encoding="utf-8")
    index = SampleIndex.build(results / JSONL_NAME)
    assert index is not None and [e.full_precision for e in index.entries] == [False, True, False, True]
    assert [e.index for e in select(index.entries, SampleQuery.parse("fullprecision"))] == [1, 3]
    assert [e.index for e in select(index.entries, SampleQuery.parse("abovetol"))] == [0]
    summary = load_summary(results)
    assert summary is not None and summary.steps is not None
    assert summary.steps.full_precision == "2 of 4 samples ran in tf32"
    assert summary.audit is not None and len(summary.audit.samples) == 2  # audit_samples = "auto": 2 on the CPU
    assert summary.audit.tolerance == 1e-2 and summary.audit.above == sum(not s.within for s in summary.audit.samples)


# --- causal LM lines per completion token (the frozen run of the demo causal LM, tests/fixtures/make_runs.py) -------
LM_RESULTS = next((Path(__file__).parents[1] / "fixtures" / "runs" / "attribution-lm").iterdir()) / "results"


def test_completion_tokens_rows_are_read_with_their_sample() -> None:
    index = SampleIndex.build(LM_RESULTS / JSONL_NAME)
    assert index is not None and index.corrupt == 0
    for entry, record in zip(index.entries, records(LM_RESULTS.parent), strict=True):
        assert (entry.completion, entry.logprob) == (record["completion"], record["logprob"])
        sample = index.read(entry)
        rows = sample.completion_tokens
        assert [(r.position, r.token, r.logprob) for r in rows] == list(
            zip(range(len(rows)), record["completion_tokens"], record["token_logprobs"])
        )
        assert [r.delta for r in rows] == record["token_deltas"]
        assert [r.relative_delta for r in rows] == record["token_relative_deltas"]
        for t, row in enumerate(rows):
            explained = sample.explaining(t)
            assert list(explained.segments[0].scores) == record["matrix"][t] == list(row.scores)
            assert explained.segments[0].tokens == sample.segments[0].tokens
            assert [[list(i.position), i.token, i.score] for i in explained.top] == [
                [[p], tok, s] for p, tok, s in record["token_top"][t]
            ]
            assert (explained.entry.delta, explained.entry.relative_delta, explained.entry.steps) == (
                row.delta,
                row.relative_delta,
                None,  # a row's steps are not recorded
            )
        assert sample.explaining(None) is sample


def test_the_index_leaves_the_per_token_tail_unparsed(tmp_path: Path) -> None:
    """A line whose per-token fields are damaged is listed; opening it says it is unreadable."""
    lines = lines_of(LM_RESULTS / JSONL_NAME)
    damaged = lines[1].replace(b', "matrix": [[', b', "matrix": [[oops')
    assert damaged != lines[1]
    path = tmp_path / JSONL_NAME
    path.write_bytes(b"".join([lines[0], damaged, *lines[2:]]))
    index = SampleIndex.build(path)
    assert index is not None and index.corrupt == 0 and len(index) == len(lines)
    assert index.read(index.entries[0]).completion_tokens
    with pytest.raises(UserError, match="unreadable"):
        index.read(index.entries[1])


def test_causal_lm_lines_in_another_layout_are_read_whole(tmp_path: Path) -> None:
    other = tmp_path / JSONL_NAME
    lines = records(LM_RESULTS.parent)
    other.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in lines), encoding="utf-8")
    index, reference = SampleIndex.build(other), SampleIndex.build(LM_RESULTS / JSONL_NAME)
    assert index is not None and reference is not None
    assert index.read(index.entries[2]).completion_tokens == reference.read(reference.entries[2]).completion_tokens


def test_rows_too_long_to_read_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gpuopt_tui.core.results.attribution.WHOLE_LINE_BYTES", 64)
    index = SampleIndex.build(LM_RESULTS / JSONL_NAME)
    assert index is not None
    sample = index.read(index.entries[0])
    assert not sample.completion_tokens and "rows take over" in sample.rows_note
    assert sample.segments[0].scores  # the whole completion's scores are read as before


def test_rows_without_their_deltas_and_top_tokens_are_named(tmp_path: Path) -> None:
    """A line of an earlier version (per-token log-probabilities and matrix only) opens, saying what it lacks."""
    record = records(LM_RESULTS.parent)[0]
    for key in ("token_deltas", "token_relative_deltas", "token_top"):
        del record[key]
    path = tmp_path / JSONL_NAME
    path.write_text(json.dumps(record) + "\n", encoding="utf-8")
    index = SampleIndex.build(path)
    assert index is not None
    sample = index.read(index.entries[0])
    assert not sample.completion_tokens and list(sample.segments[0].scores) == record["scores"]
    assert "lack token_deltas, token_relative_deltas, token_top (an earlier version's run)" in sample.rows_note
