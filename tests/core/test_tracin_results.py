"""The torch-free reader of TracIn result files, on files the real engine wrote for the demo classifier, checked
against a plain read of the same files; pages against a full read; CSV records with quotes and line breaks; the
summary of a run over all layers with projected gradients, the training-gradient cache and the check against
exact TracIn."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from gpuopt_tui.core.caches import gradients as gradient_cache
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.paths import cache_dir
from gpuopt_tui.core.profiles.io import find_profile, load_profile
from gpuopt_tui.core.results.tracin import (
    SELF_CSV_NAME,
    SELF_JSONL_NAME,
    PagedRecords,
    RankedExample,
    load_results,
    parse_influence,
    parse_ranked,
)
from gpuopt_tui.core.results.tracin_summary import Agreement, CacheUse, Projection, parse_summary
from gpuopt_tui.core.runs.events import EventWriter
from gpuopt_tui.core.runs.layout import RunDir

#: the demo over all layers, gradients projected to 8 x 8 per layer, training gradients cached, checked against
#: exact all-parameter TracIn on 40 training examples
FACTORED = [
    "tracin.n_train=120",
    "tracin.layers=all",
    "tracin.method=factored",
    "tracin.projection_in=8",
    "tracin.projection_out=8",
    "tracin.train_cache=true",
    "tracin.agreement_train=40",
]


def demo_run(folder: Path, overrides: list[str]) -> Path:
    """The results folder of a real TracIn run of the demo profile on the CPU."""
    from gpuopt_tui.jobs.context import JobContext
    from gpuopt_tui.jobs.tracin.job import run_job

    profile = load_profile(find_profile("demo-tracin"), ["run.device=cpu", *overrides])
    run_job(profile, JobContext(folder, EventWriter(RunDir(folder).events), cache_dir()))
    return RunDir(folder).results


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo profile's own settings (last layers, exact), 6 test examples."""
    return demo_run(tmp_path_factory.mktemp("tracin-run"), ["tracin.n_test=6"])


@pytest.fixture(scope="module")
def factored_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two runs of FACTORED with an empty gradient cache at first: 6 test examples (fills the cache), then 3
    other ones (reads it)."""
    gradient_cache.clear()
    first = demo_run(tmp_path_factory.mktemp("tracin-factored"), [*FACTORED, "tracin.n_test=6"])
    second = demo_run(tmp_path_factory.mktemp("tracin-cached"), [*FACTORED, "tracin.n_test=3"])
    return first, second


def raw_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_reader_shows_what_the_engine_wrote(results: Path) -> None:
    read = load_results(results)
    raw = json.loads((results / "summary.json").read_text())
    s = read.summary
    assert s is not None
    assert (s.n_test, s.n_train, s.n_scored) == (6, raw["n_train"], raw["n_train"])
    assert [(c.path, c.lr) for c in s.checkpoints] == [(c["path"], c["lr"]) for c in raw["checkpoints"]]
    assert s.n_parameters == raw["n_parameters"] and list(s.parameter_tensors) == raw["parameter_tensors"]
    assert s.method == "closed_form" and s.mode == "closed form, exact gradients" and s.layers == "last 2 modules"
    assert s.train_examples_per_s == raw["timing"]["train_examples_per_s"] > 0
    assert s.flipped_label_auc == raw["flipped_label_auc"] >= 0.9
    assert s.label_names == tuple(raw["label_names"]) and len(s.label_names) == 2
    assert s.predictions_checkpoint == raw["checkpoints"][-1]["path"]
    assert s.label_name(1) == s.label_names[1] and s.label_name(7) == "7" and s.label_name(None) == "-"
    assert (s.projection, s.excluded_parameters, s.train_cache, s.agreement) == (None, (), None, None)

    tests = raw_lines(results / "influence.jsonl")
    assert read.influence is not None and len(read.influence) == 6
    for record, line in zip(read.influence.page(0, 100), tests, strict=True):
        assert (record.index, record.text, record.label) == (line["index"], line["text"], line["label"])
        assert (record.prediction, record.probability) == (line["prediction"], line["probability"])
        assert record.label_probability == line["label_probability"]
        assert 0 < record.label_probability <= record.probability <= 1
        for side in ("proponents", "opponents"):
            got = [(n.index, n.score, n.text, n.label) for n in getattr(record, side)]
            assert got == [(n["index"], n["score"], n["text"], n["label"]) for n in line[side]]
            assert len(got) == 5  # the demo profile's top_k

    ranked = raw_lines(results / "self_influence.jsonl")
    assert read.self_influence is not None and len(read.self_influence) == len(ranked) == s.n_train
    rows = read.self_influence.page(0, len(ranked))
    assert [r.rank for r in rows] == list(range(1, len(ranked) + 1))
    assert [r.score for r in rows] == sorted((r.score for r in rows), reverse=True)
    assert [(r.index, r.flipped) for r in rows] == [(r["index"], r["flipped"]) for r in ranked]
    assert any(r.flipped for r in rows) and not all(r.flipped for r in rows)
    assert [p.name for p, _ in read.files()][:3] == ["influence.jsonl", "self_influence.jsonl", "self_influence.csv"]


def test_files_of_older_runs_without_predictions_or_label_names_are_read(results: Path) -> None:
    line = raw_lines(results / "influence.jsonl")[0]
    for key in ("prediction", "probability", "label_probability"):
        del line[key]
    record = parse_influence(line)
    assert (record.prediction, record.probability, record.label_probability) == (None, None, None)
    raw = json.loads((results / "summary.json").read_text())
    del raw["label_names"], raw["predictions_checkpoint"]
    assert raw["optimizer_state"] is None  # the default: plain training gradients
    del raw["projection"], raw["excluded_parameters"], raw["train_cache"], raw["agreement"], raw["optimizer_state"]
    old = parse_summary(raw)
    assert old.label_names is None and old.predictions_checkpoint == "" and old.label_name(1) == "1"
    assert (old.projection, old.excluded_parameters, old.train_cache, old.agreement) == (None, (), None, None)
    raw["settings"]["projection_dim"] = 64  # older runs name a dense projection in the settings only
    dense = parse_summary(raw).projection
    assert dense == Projection("dense", None, dim=64)
    assert parse_summary(raw).mode == "closed form, random projection to ≤64 numbers per tensor"


def test_summary_says_what_layers_auto_chose_and_why(results: Path) -> None:
    raw = json.loads((results / "summary.json").read_text())
    assert raw["parameter_choice"] == {"layers": "last", "source": "tracin.layers = last"}  # the demo profile's
    source = "tracin.layers = auto, as the checkpoints are PEFT adapters"
    raw["settings"]["layers"] = "auto"
    raw["parameter_choice"] = {"layers": "adapter", "source": source}
    assert parse_summary(raw).layers == f"the PEFT adapter's trainable ones; {source}"
    raw["parameter_choice"] = {"layers": "last", "source": "tracin.layers = auto, as the checkpoints are full ..."}
    assert parse_summary(raw).layers == "last 2 modules; tracin.layers = auto, as the checkpoints are full ..."
    raw["settings"]["layers"] = "adapter"  # set in the profile: nothing to explain
    raw["parameter_choice"] = {"layers": "adapter", "source": "tracin.layers = adapter"}
    assert parse_summary(raw).layers == "the PEFT adapter's trainable ones"


def test_summary_of_a_run_over_all_layers_says_projection_cache_and_agreement(
    factored_results: tuple[Path, Path],
) -> None:
    first, second = factored_results
    raw = json.loads((first / "summary.json").read_text())
    s = load_results(first).summary
    assert s is not None
    assert s.method == "factored" and s.layers == "all"
    assert s.projection == Projection("factored", raw["projection"]["seed"], size_in=8, size_out=8)
    assert s.mode == "factored (all-layer hooks), each layer's gradient projected to 8 × 8 (output × input)"
    fitted = {**raw["projection"], "basis": "pca", "pca_examples": 64}
    assert parse_summary({**raw, "projection": fitted}).mode == (
        "factored (all-layer hooks), each layer's gradient projected to 8 × 8 (output × input), along its main "
        "directions over 64 training examples (PCA)"
    )
    timed = parse_summary({**raw, "timing": {**raw["timing"], "compute_seconds": 9.0, "projection_fit_seconds": 2.5}})
    assert timed.projection_fit_seconds == 2.5
    assert s.excluded_parameters == tuple(raw["excluded_parameters"])
    assert s.gradient_size == raw["gradient_size"] < s.n_parameters
    agreement = raw["agreement"]
    assert s.agreement == Agreement(
        reference=agreement["reference"],
        n_train=40,
        n_test=6,
        spearman=agreement["spearman"],
        top_k=10,
        top_k_overlap=agreement["top_k_overlap"],
        excluded_from_reference=tuple(agreement["excluded_from_reference"]),
    )
    assert -1 <= s.agreement.spearman <= 1 and 0 <= s.agreement.top_k_overlap <= 1
    blocks = len(s.checkpoints)  # 120 training examples: one block per checkpoint
    assert s.train_cache == CacheUse(read=0, computed=blocks)
    again = load_results(second).summary
    assert again is not None and again.n_test == 3
    assert again.train_cache == CacheUse(read=blocks, computed=0)  # other test examples, the same training ones


def test_agreement_of_a_low_precision_run_carries_its_settings_in_fp32(
    factored_results: tuple[Path, Path],
) -> None:
    raw = json.loads((factored_results[0] / "summary.json").read_text())
    checked = {**raw["agreement"], "precision": "bf16", "fp32": {"spearman": 0.93, "top_k_overlap": 0.5}}
    s = parse_summary({**raw, "agreement": checked})
    assert s.agreement is not None and s.agreement.fp32 == (0.93, 0.5)
    assert parse_summary(raw).agreement.fp32 is None  # type: ignore[union-attr]  # an fp32 run


ADAM = {
    "kind": "adam",
    "description": "Adam-preconditioned training gradients (optimizer.pt of each checkpoint)",
    "formula": "Γ(g) = m̂/(√v̂+ε)",
    "checkpoints": [
        {"file": "a/optimizer.pt", "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "step": 100},
        {"file": "b/optimizer.pt", "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "step": [200, 210]},
    ],
}


def test_summary_names_the_adam_preconditioning_with_its_settings(results: Path) -> None:
    raw = json.loads((results / "summary.json").read_text())
    s = parse_summary({**raw, "optimizer_state": ADAM})
    assert s.optimizer_state is not None and s.optimizer_state.formula == ADAM["formula"]
    assert s.optimizer_state.text == (
        "Adam-preconditioned training gradients (optimizer.pt of each checkpoint): β1 0.9, β2 0.999, ε 1e-08, "
        "step 100 / 200–210"
    )
    assert s.mode.endswith(", Adam-preconditioned training gradients")
    other = {**ADAM, "checkpoints": [ADAM["checkpoints"][0], {**ADAM["checkpoints"][0], "beta2": 0.95}]}
    assert parse_summary({**raw, "optimizer_state": other}).optimizer_state.text.endswith(  # type: ignore[union-attr]
        ": β1 0.9, β2 0.999, ε 1e-08, step 100; β1 0.9, β2 0.95, ε 1e-08, step 100"
    )


def test_bad_projection_cache_or_agreement_names_the_key(results: Path, tmp_path: Path) -> None:
    raw = json.loads((results / "summary.json").read_text())
    raw_agreement = {
        "reference": "exact",
        "n_train": 4,
        "n_test": 2,
        "spearman": 0.5,
        "top_k": 10,
        "top_k_overlap": 0.5,
    }
    for key, value, message in [
        ("projection", {"kind": "sparse", "seed": 0}, "projection.kind: expected dense or factored"),
        ("projection", {"kind": "factored", "in": 8, "seed": 0}, "no 'out'"),
        (
            "projection",
            {"kind": "factored", "in": 8, "out": 8, "seed": 0, "basis": "svd"},
            "projection.basis: expected random or pca, found 'svd'",
        ),
        ("train_cache", {"read": "all", "computed": 0}, "train_cache.read: expected an integer"),
        ("agreement", [0.9], "agreement: expected an object"),
        (
            "agreement",
            {**raw_agreement, "fp32": {"spearman": 0.9}},
            "agreement.fp32.top_k_overlap: expected a number, found None",
        ),
        ("excluded_parameters", "bias", "excluded_parameters: expected a list"),
        ("optimizer_state", {**ADAM, "kind": "sgd"}, "optimizer_state.kind: expected adam, found 'sgd'"),
        (
            "optimizer_state",
            {**ADAM, "checkpoints": [{**ADAM["checkpoints"][0], "eps": "tiny"}]},
            "optimizer_state.checkpoints[0].eps: expected a number, found 'tiny'",
        ),
    ]:
        (tmp_path / "summary.json").write_text(json.dumps({**raw, key: value}))
        with pytest.raises(UserError, match=re.escape(message)):
            load_results(tmp_path)


@pytest.mark.parametrize("is_csv", [False, True], ids=["jsonl", "csv"])
def test_pages_match_a_full_read(results: Path, is_csv: bool) -> None:
    name = SELF_CSV_NAME if is_csv else SELF_JSONL_NAME
    full = [parse_ranked(r) for r in raw_lines(results / SELF_JSONL_NAME)]
    paged = PagedRecords(results / name, parse_ranked, is_csv=is_csv, stride=7)
    n = len(full)
    assert len(paged) == n
    for start, count in [(0, 3), (5, 9), (7, 7), (13, 30), (n - 4, 10), (n - 1, 1), (n, 5), (3, 0), (-1, 2)]:
        expected = full[start : start + count] if start >= 0 else []
        assert paged.page(start, count) == expected, (start, count)
    assert [r for s in range(0, n, 50) for r in paged.page(s, 50)] == full


def write_csv(path: Path, rows: list[dict[str, object]]) -> None:
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_csv_records_may_hold_quotes_commas_and_line_breaks(tmp_path: Path) -> None:
    texts = ['say "no", twice', "first line\nsecond line", "", "plain", 'a ""quoted"" "\n" mess,', "ünïcode, ok"]
    rows = [
        {"rank": i + 1, "index": 10 * i, "self_influence": 1.0 / (i + 1), "label": i % 3 if i != 2 else "", "text": t}
        for i, t in enumerate(texts)
    ]
    path = tmp_path / "self_influence.csv"
    write_csv(path, rows)
    with path.open(encoding="utf-8", newline="") as f:
        expected = [parse_ranked(r) for r in csv.DictReader(f)]
    paged = PagedRecords(path, parse_ranked, is_csv=True, stride=2)
    assert len(paged) == len(texts)
    assert paged.page(0, 10) == expected and paged.page(3, 2) == expected[3:5]
    assert [r.text for r in expected] == texts
    assert expected[2].label is None and all(r.flipped is None for r in expected)  # no `flipped` column: unknown


def test_a_file_written_again_is_read_again(results: Path, tmp_path: Path) -> None:
    path = tmp_path / SELF_JSONL_NAME
    lines = (results / SELF_JSONL_NAME).read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:40]))
    paged = PagedRecords(path, parse_ranked, stride=4)
    assert len(paged) == 40
    tmp = tmp_path / "new.jsonl"
    tmp.write_text("".join(lines[:9]))
    os.replace(tmp, path)
    assert len(paged) == 9 and paged.page(8, 5) == [parse_ranked(json.loads(lines[8]))]


def test_bad_records_name_the_file_and_line(results: Path, tmp_path: Path) -> None:
    lines = (results / "influence.jsonl").read_text().splitlines()
    broken = tmp_path / "influence.jsonl"
    broken.write_text("\n".join([lines[0], lines[1], "{not json", *lines[3:]]) + "\n")
    paged = PagedRecords(broken, parse_influence, stride=2)
    assert len(paged.page(0, 2)) == 2
    with pytest.raises(UserError, match=r"influence\.jsonl: line 3: "):
        paged.page(1, 3)

    record = json.loads(lines[0])
    del record["opponents"]
    record["proponents"][0]["score"] = "high"
    broken.write_text(json.dumps(record) + "\n")
    with pytest.raises(UserError, match=r"line 1: proponents\[0\]\.score: expected a number"):
        PagedRecords(broken, parse_influence).page(0, 1)

    rows = [{"rank": 1, "index": 2, "self_influence": 0.5, "label": 1, "text": "x", "flipped": "maybe"}]
    write_csv(tmp_path / "bad.csv", rows)
    with pytest.raises(UserError, match=r"bad\.csv: row 1: flipped: expected true or false"):
        PagedRecords(tmp_path / "bad.csv", parse_ranked, is_csv=True).page(0, 1)


def test_summary_that_is_not_a_tracin_summary_is_a_user_error(results: Path, tmp_path: Path) -> None:
    folder = RunDir(tmp_path).results
    folder.mkdir()
    summary = json.loads((results / "summary.json").read_text())
    del summary["n_parameters"]
    (folder / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(UserError, match=r"summary\.json: no 'n_parameters'"):
        load_results(folder)
    (folder / "summary.json").write_text("[1, 2]")
    with pytest.raises(UserError, match=r"summary\.json: expected a JSON object"):
        load_results(folder)


def test_a_run_in_progress_shows_only_the_files_that_exist(results: Path, tmp_path: Path) -> None:
    folder = RunDir(tmp_path).results
    missing = load_results(folder)
    assert missing.empty and missing.files() == []

    folder.mkdir()
    shutil.copy(results / SELF_CSV_NAME, folder)
    partial = load_results(folder)
    assert partial.summary is None and partial.influence is None and not partial.empty
    assert partial.self_influence is not None and partial.self_influence.is_csv  # the CSV when there is no JSONL
    first: list[RankedExample] = partial.self_influence.page(0, 3)
    assert first == [parse_ranked(r) for r in raw_lines(results / SELF_JSONL_NAME)[:3]]
    assert [p.name for p, _ in partial.files()] == [SELF_CSV_NAME]
