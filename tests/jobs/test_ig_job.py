"""The attribution run end to end on a tiny Hugging Face model directory and a jsonl dataset: result files,
per-sample results against a direct engine call, bucketing, the reference path, cancel + resume."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from run_stages import hf_load_stages, stages
from safetensors.torch import load_file
from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.io import profile_from_data
from gpuopt_tui.core.results.attribution import SampleIndex
from gpuopt_tui.core.runs.events import EventWriter, read_events
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.jobs.attribution import IGOptions, integrated_gradients
from gpuopt_tui.jobs.attribution.check import CHECK_STAGES
from gpuopt_tui.jobs.attribution.engine import Settings
from gpuopt_tui.jobs.attribution.job import run_job
from gpuopt_tui.jobs.attribution.outputs import float32_values
from gpuopt_tui.jobs.attribution.panels import step_counts
from gpuopt_tui.jobs.context import JobCancelled, JobContext

N_SAMPLES = 22
WORDS = [f"w{i}" for i in range(55)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny BERT classifier with its tokenizer, and 22 labelled texts of 1 to 14 words."""
    root = tmp_path_factory.mktemp("ig_job")
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=60,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
        initializer_range=0.3,
    )
    BertForSequenceClassification(config).save_pretrained(root / "model")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(root / "model")
    rng = random.Random(4)
    lines = []
    for i in range(N_SAMPLES):
        text = " ".join(rng.choice(WORDS[:20]) for _ in range(rng.randint(1, 14)))
        lines.append(json.dumps({"text": text, "label": i % 2}))
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")
    (root / "unlabelled.jsonl").write_text(json.dumps({"text": "w1 w2"}) + "\n")
    return root


def profile(workdir: Path, data_file: str = "data.jsonl", **attribution: Any):
    settings = {"n_steps": 8, "method": "riemann_middle", "batch_size": 4, "top_k": 5, "top_k_sample": 3}
    settings.update(attribution)
    return profile_from_data(
        {
            "kind": "attribution",
            "run": {"device": "cpu"},
            "model": {"adapter": "hf", "path": str(workdir / "model")},
            "data": {"source": "jsonl", "path": str(workdir / data_file), "max_length": 16},
            "attribution": settings,
        },
        "test.toml",
    )


def context(run_dir: Path, cls: type[JobContext] = JobContext) -> JobContext:
    run_dir.mkdir(parents=True, exist_ok=True)
    return cls(run_dir, EventWriter(RunDir(run_dir).events), run_dir / "cache")


def results(run_dir: Path) -> tuple[list[dict], dict, dict[str, torch.Tensor]]:
    lines = (RunDir(run_dir).results / "attributions.jsonl").read_text().splitlines()
    summary = json.loads((RunDir(run_dir).results / "summary.json").read_text())
    return (
        [json.loads(line) for line in lines],
        summary,
        load_file(RunDir(run_dir).results / "attributions.safetensors"),
    )


@pytest.fixture(scope="module")
def finished(workdir: Path) -> Path:
    run_dir = workdir / "runs" / "plain"
    run_job(profile(workdir), context(run_dir))
    return run_dir


def test_a_run_reports_each_stage(finished: Path) -> None:
    assert stages(finished / "events.jsonl") == [
        "loading the model",
        *hf_load_stages(),
        "reading data.jsonl",
        f"tokenizing {N_SAMPLES} examples of data.jsonl",
        "preparing the engine",
        "attribution [samples]",
        "collecting the batches [batches]",
        "audit: strict fp32 reference [samples]",  # audit_samples = "auto": 2 on the CPU
        "writing results",
        "attribution [samples]",  # said again at the end: run lists show the samples
    ]


def test_result_files(finished: Path) -> None:
    records, summary, tensors = results(finished)
    assert [r["index"] for r in records] == list(range(N_SAMPLES))
    for r in records:
        assert len(r["tokens"]) == len(r["scores"]) >= 3
        assert r["tokens"][0] == "[CLS]" and r["tokens"][-1] == "[SEP]"
        assert r["scores"][0] == 0 and r["scores"][-1] == 0  # kept in the [PAD] baseline
        assert 0 <= r["probability"] <= 1 and r["prediction"] == r["target"]  # target = predicted
        assert len(r["top"]) == min(3, len(r["tokens"]) - 2)
        assert all(tok not in ("[CLS]", "[SEP]") for _, tok, _ in r["top"])
        tops = [abs(s) for _, _, s in r["top"]]
        assert tops == sorted(tops, reverse=True)
    assert tensors["scores"].shape[0] == N_SAMPLES
    lengths = tensors["lengths"]
    assert lengths.tolist() == [len(r["tokens"]) for r in records]
    for i in range(N_SAMPLES):  # the JSON scores read back as exactly the fp32 values
        assert torch.equal(tensors["scores"][i, : lengths[i]], torch.tensor(records[i]["scores"]))
        assert (tensors["scores"][i, lengths[i] :] == 0).all()
    assert torch.equal(tensors["deltas"], torch.tensor([r["delta"] for r in records]))
    assert summary["n_samples"] == N_SAMPLES and summary["settings"]["precision"] == "fp32"
    assert 0 < len(summary["top_k"]) <= 5
    means = [entry["mean_share"] for entry in summary["top_k"]]
    assert means == sorted(means, reverse=True) and all(e["count"] >= 3 for e in summary["top_k"])
    assert set(summary["deltas"]) >= {"median_rel", "p95_rel", "warning", "suggested_n_steps"}
    events, _ = read_events(RunDir(finished).events)
    assert {e["path"] for e in events if e["type"] == "artifact"} == {
        "results/attributions.jsonl",
        "results/attributions.safetensors",
        "results/summary.json",
    }
    progress = [e for e in events if e["type"] == "progress"]
    assert progress[-1]["done"] == progress[-1]["total"] == N_SAMPLES
    index = SampleIndex.build(RunDir(finished).results / "attributions.jsonl")  # from the index written with it
    assert index is not None and index.index_file == RunDir(finished).results / "attributions.index.jsonl"
    assert [e.index for e in index.entries] == list(range(N_SAMPLES))


def test_json_floats_are_the_shortest_exact_fp32_decimals() -> None:
    values = torch.tensor([0.1, -1e-12, 3.4028235e38, 1 / 3, 0.0, 2.5e-45, 123456.79], dtype=torch.float32)
    values = torch.cat([values, torch.randn(5000) * 10.0 ** torch.randint(-9, 4, (5000,))])
    written = json.dumps(float32_values(values))
    assert written.startswith("[0.1, -1e-12, 3.4028235e+38, 0.33333334, 0.0, 3e-45, 123456.79, ")
    assert torch.equal(torch.tensor(json.loads(written), dtype=torch.float32), values)


def test_scores_match_a_direct_engine_call(workdir: Path, finished: Path) -> None:
    """Sample by sample, outside the job: tokenizer, [PAD] baseline keeping [CLS]/[SEP], the engine."""
    model = BertForSequenceClassification.from_pretrained(workdir / "model").eval()
    tokenizer = BertTokenizer.from_pretrained(workdir / "model")
    records, _, _ = results(finished)
    for i in (0, 5, 13, 21):
        enc = tokenizer(records[i]["text"], return_tensors="pt")
        ids, mask = enc["input_ids"], enc["attention_mask"]
        emb = model.get_input_embeddings()(ids).detach()
        keep = (ids == tokenizer.cls_token_id) | (ids == tokenizer.sep_token_id)
        base = torch.where(keep.unsqueeze(-1), emb, model.get_input_embeddings().weight[tokenizer.pad_token_id])
        result = integrated_gradients(
            lambda e, m, c: model(inputs_embeds=e, attention_mask=m).logits,
            emb,
            base.detach(),
            mask,
            options=IGOptions(n_steps=8, method="riemann_middle"),
        )
        assert result.token_scores()[0].tolist() == pytest.approx(records[i]["scores"], rel=1e-4, abs=1e-6)
        assert float(result.deltas[0]) == pytest.approx(records[i]["delta"], abs=1e-5)


def test_bucketing_and_the_reference_path_give_the_same_scores(workdir: Path, finished: Path) -> None:
    expected, _, _ = results(finished)
    for name, settings in (
        ("unbucketed", {"length_bucketing": False, "batch_size": 5}),
        ("reference", {"use_optimized": False, "check_samples": 4}),
    ):
        run_dir = workdir / "runs" / name
        summary = run_job(profile(workdir, **settings), context(run_dir))
        records, _, _ = results(run_dir)
        for got, want in zip(records, expected):
            assert got["tokens"] == want["tokens"]
            assert got["scores"] == pytest.approx(want["scores"], rel=1e-4, abs=1e-6)
    check = json.loads((RunDir(run_dir).results / "check.json").read_text())
    assert check["n_samples"] == 4 and check["max_rel_diff"] < 1e-5
    assert summary["check_max_rel_diff"] == check["max_rel_diff"]
    events = [json.loads(line) for line in RunDir(run_dir).events.read_text().splitlines()]
    progress = [e for e in events if e["type"] == "progress"]
    # the check reports each path's progress in steps after the attribution; the run then ends on its samples
    check = [e for e in progress if e.get("stage") in CHECK_STAGES.values()]
    assert [e["stage"] for e in (check[0], check[-1])] == list(CHECK_STAGES.values())
    assert (check[-1]["done"], check[-1]["total"], check[-1]["unit"]) == (4 * 8, 4 * 8, "steps")
    for name in CHECK_STAGES.values():  # each path shows its own rate
        assert [e for e in check if e["stage"] == name][-1]["rate"] > 0
    assert progress[-1]["stage"] == "attribution"
    assert (progress[-1]["done"], progress[-1]["total"], progress[-1]["unit"]) == (22, 22, "samples")


class CancelAfterFirstBatch(JobContext):
    def save_shard(self, name, write):
        path = super().save_shard(name, write)
        if name.startswith("batch_"):
            self.request_cancel()  # as SIGTERM would, while the next batch is being computed
        return path


def test_cancel_then_resume_gives_the_uninterrupted_results(workdir: Path, finished: Path) -> None:
    run_dir = workdir / "runs" / "resumed"
    with pytest.raises(JobCancelled):
        run_job(profile(workdir), context(run_dir, CancelAfterFirstBatch))
    assert sorted(p.name for p in RunDir(run_dir).state.glob("batch_*")) == ["batch_00000.safetensors"]
    assert not (RunDir(run_dir).results / "attributions.jsonl").exists()
    run_job(profile(workdir), context(run_dir))
    events, _ = read_events(RunDir(run_dir).events)
    assert any("resuming: 1 of 6 batches" in e.get("message", "") for e in events)
    got, expected = results(run_dir), results(finished)
    assert got[0] == expected[0]
    assert torch.equal(got[2]["scores"], expected[2]["scores"])
    with pytest.raises(UserError, match=r"the settings changed since the run started \(n_steps: 8 -> 9\)"):
        run_job(profile(workdir, n_steps=9), context(run_dir))


def prefix_texts(folder: Path) -> None:
    """The same number of texts, each with three more words first."""
    path = folder / "data.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "text": "w1 w1 w1 " + r["text"]}) + "\n" for r in rows))


def rewrite_weights_keeping_size_and_mtime(folder: Path) -> None:
    path = folder / "model" / "model.safetensors"
    st = path.stat()
    raw = bytearray(path.read_bytes())
    raw[-4:] = bytes(b ^ 0x5A for b in raw[-4:])  # the last weight's value
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def swap_two_words(folder: Path) -> None:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    vocab[-1], vocab[-2] = vocab[-2], vocab[-1]  # words the texts never use: the same token ids
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(folder / "model")


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (prefix_texts, r"the data changed since the run started \(/.*data.jsonl\)"),
        (rewrite_weights_keeping_size_and_mtime, r"the model weights changed since the run started \(model.path /.*\)"),
        (swap_two_words, r"the tokenizer changed since the run started \(model.path /.*\)"),
    ],
)
def test_resume_refuses_shards_made_from_other_inputs(
    workdir: Path, tmp_path: Path, change: Callable[[Path], None], refusal: str
) -> None:
    shutil.copytree(workdir / "model", tmp_path / "model")
    shutil.copy(workdir / "data.jsonl", tmp_path)
    run_dir = tmp_path / "run"
    unsorted = profile(tmp_path, length_bucketing=False)  # the same batches whatever the texts' lengths
    with pytest.raises(JobCancelled):
        run_job(unsorted, context(run_dir, CancelAfterFirstBatch))
    shard = RunDir(run_dir).state / "batch_00000.safetensors"
    before = shard.read_bytes()
    change(tmp_path)
    with pytest.raises(UserError, match=rf"^resume refused: {refusal}: start a new run$"):
        run_job(unsorted, context(run_dir))
    assert shard.read_bytes() == before and not (RunDir(run_dir).results / "attributions.jsonl").exists()


def test_user_errors(workdir: Path, tmp_path: Path) -> None:
    cases = [
        (profile(workdir, "unlabelled.jsonl", target="label"), 'target = "label" but the data has no labels'),
        (profile(workdir, target="5"), "has 2 outputs"),
        (profile(workdir, baseline="custom", custom_baseline_token="nope"), "not a single token"),
    ]
    for i, (bad, message) in enumerate(cases):
        with pytest.raises(UserError, match=message):
            run_job(bad, context(tmp_path / str(i)))


def test_an_fp16_overflow_is_redone_in_bf16(workdir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Classifier weights x 1e6 give logits and gradients beyond fp16's range (65504), not bf16's."""
    model = BertForSequenceClassification.from_pretrained(workdir / "model")
    with torch.no_grad():
        model.classifier.weight.mul_(1e6)
    model.save_pretrained(tmp_path / "model")
    BertTokenizer.from_pretrained(workdir / "model").save_pretrained(tmp_path / "model")
    (tmp_path / "data.jsonl").write_text((workdir / "data.jsonl").read_text())
    resolve = Settings.resolve  # on the CPU it gives fp32: ask for fp16 weights as on a GPU
    monkeypatch.setattr(Settings, "resolve", lambda *args: resolve(*args).with_ig(precision="fp16", cast_weights=True))
    run_dir = tmp_path / "run"
    run_job(profile(tmp_path, n_samples=8), context(run_dir))
    events, _ = read_events(RunDir(run_dir).events)
    assert [e["rows"] for e in events if e["type"] == "fp16_overflow"] == [4, 4]
    assert any("redone in bf16" in e.get("message", "") for e in events)
    records, summary, _ = results(run_dir)
    assert summary["settings"]["precision"] == "fp16" and len(records) == 8
    assert all(math.isfinite(s) for r in records for s in r["scores"]) and any(r["scores"][1] != 0 for r in records)


def test_a_tolerance_below_what_the_steps_resolve_is_named_up_front(workdir: Path) -> None:
    run_dir = workdir / "runs" / "auto-fine"
    run_job(profile(workdir, n_steps="auto", tolerance=1e-7, max_steps=17, n_samples=4), context(run_dir))
    events, _ = read_events(RunDir(run_dir).events)
    warnings = [e["message"] for e in events if e["type"] == "warning"]
    assert any("tolerance 1e-07 is below what fp32 steps resolve" in w for w in warnings), warnings


def test_auto_steps_are_recorded_per_sample_and_resume(workdir: Path) -> None:
    auto = {"n_steps": "auto", "tolerance": 1e-3, "max_steps": 65}
    run_dir = workdir / "runs" / "auto"
    with pytest.raises(JobCancelled):
        run_job(profile(workdir, **auto), context(run_dir, CancelAfterFirstBatch))
    run_job(profile(workdir, **auto), context(run_dir))
    records, summary, tensors = results(run_dir)
    steps = [r["steps"] for r in records]
    assert set(steps) <= set(step_counts(65)) and torch.equal(tensors["steps"], torch.tensor(steps))
    # honest verdicts: a sample is within the tolerance exactly when both figures written for it are
    for r in records:
        assert r["within_tolerance"] == (r["relative_delta"] <= 1e-3 and r["error_estimate"] <= 1e-3)
    assert all(r["within_tolerance"] for r in records if r["steps"] < 65)
    assert summary["settings"]["method"] == "adaptive_simpson"
    assert summary["steps"]["total"] == sum(steps) and summary["steps"]["mode"] == "auto"
    assert sum(count for _, count in summary["steps"]["histogram"]) == N_SAMPLES
    above = [r["index"] for r in records if not r["within_tolerance"]]
    assert summary["steps"]["above_tolerance"] == len(above) and summary["steps"]["above_tolerance_samples"] == above
    uninterrupted = workdir / "runs" / "auto-whole"
    run_job(profile(workdir, **auto, check_samples=2), context(uninterrupted))  # the check: fixed steps
    assert results(uninterrupted)[0] == records
    with pytest.raises(UserError, match=r"the settings changed .* \(tolerance: 0.001 -> 0.01\)"):
        run_job(profile(workdir, **{**auto, "tolerance": 1e-2}), context(run_dir))
    with pytest.raises(UserError, match="use_optimized"):
        profile(workdir, **auto, use_optimized=False)
