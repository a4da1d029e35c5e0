"""The TracIn run kind end to end: a local Hugging Face model, jsonl data, checkpoint files, result files,
resume, and the errors a user can fix."""

from __future__ import annotations

import csv
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from run_stages import hf_load_stages, stages
from safetensors.torch import load_file
from test_tracin_support import max_rel_error, save_checkpoints
from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.io import load_profile
from gpuopt_tui.core.runs.events import EventWriter, read_events
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.jobs.context import JobContext
from gpuopt_tui.jobs.data import load_dataset
from gpuopt_tui.jobs.models.base import Adapter, Checkpoint
from gpuopt_tui.jobs.models.hf import load_hf_adapter
from gpuopt_tui.jobs.tracin import TracInOptions, select_parameters, tracin_scores
from gpuopt_tui.jobs.tracin.faithfulness import AGREEMENT_EXACT, AGREEMENT_RUN
from gpuopt_tui.jobs.tracin.job import run_job
from gpuopt_tui.jobs.tracin.scores import TracInRun

WORDS = [f"w{i}" for i in range(30)]
PREDICTING = "predicting the test examples (last checkpoint)"


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory, train/test jsonl files and three checkpoints (two safetensors, one torch file)."""
    root = tmp_path_factory.mktemp("project")
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=5 + len(WORDS),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
        initializer_range=0.3,
    )
    BertForSequenceClassification(config).save_pretrained(root / "model")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(root / "model")
    gen = torch.Generator().manual_seed(1)
    for name, n in (("train", 12), ("test", 3)):
        lines = []
        for _ in range(n):
            length = int(torch.randint(2, 9, (1,), generator=gen))
            text = " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (length,), generator=gen))
            lines.append(json.dumps({"text": text, "label": int(torch.randint(0, 2, (1,), generator=gen))}))
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    adapter = load_hf_adapter(root / "model", torch.device("cpu"))
    checkpoints = save_checkpoints(adapter, root, lrs=(0.3, 0.2, 0.1))
    torch.save(load_file(str(checkpoints[2].path)), root / "ckpt2.pt")
    return root


def write_profile(root: Path, tmp_path: Path, extra: str = "", checkpoints: str = "") -> Path:
    checkpoints = checkpoints or (
        f'{{ path = "{root}/ckpt0.safetensors", lr = 0.3 }}, {{ path = "{root}/ckpt1.safetensors", lr = 0.2 }}, '
        f'{{ path = "{root}/ckpt2.pt", lr = 0.1 }}'
    )
    text = f"""kind = "tracin"
[run]
device = "cpu"
[model]
adapter = "hf"
path = "{root}/model"
[data]
source = "jsonl"
path = "{root}/test.jsonl"
[tracin]
train_path = "{root}/train.jsonl"
checkpoints = [{checkpoints}]
layers = "last"
n_last_layers = 2
top_k = 3
shard_size = 5
n_test = 0
{extra}
"""
    path = tmp_path / "tracin.toml"
    path.write_text(text)
    return path


def context(run_dir: Path, tmp_path: Path) -> JobContext:
    run_dir.mkdir(exist_ok=True)
    return JobContext(run_dir, EventWriter(RunDir(run_dir).events), tmp_path / "cache")


def test_run_writes_results_that_match_the_library(project: Path, tmp_path: Path) -> None:
    profile = load_profile(write_profile(project, tmp_path))
    run_dir = tmp_path / "run"
    summary = run_job(profile, context(run_dir, tmp_path))
    results = RunDir(run_dir).results
    assert summary["n_scored"] == 12 and summary["train_examples_per_s"] > 0
    assert "flipped_label_auc" not in summary  # the data marks no flipped labels: no line saying None

    adapter = load_hf_adapter(project / "model", torch.device("cpu"))
    train = load_dataset(profile.data, adapter, path=project / "train.jsonl")
    test = load_dataset(profile.data, adapter)
    names = select_parameters(adapter, test.batch([0]), "last", 2)
    expected = tracin_scores(adapter, profile_checkpoints(project), train, test, names, TracInOptions(top_k=3))

    matrix = load_file(str(results / "scores.safetensors"))
    assert max_rel_error(matrix["scores"], expected.matrix) < 1e-5
    assert torch.equal(matrix["train_index"], torch.arange(12))

    records = [json.loads(line) for line in (results / "influence.jsonl").read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2]
    for record, rows in zip(records, expected.proponents.rows.tolist()):
        assert [p["index"] for p in record["proponents"]] == rows
        assert all(p["text"] == train.texts[p["index"]] for p in record["proponents"] + record["opponents"])
        assert record["text"] == test.texts[record["index"]]
    adapter.load_weights(project / "ckpt2.pt")  # predictions come from the last checkpoint, one example at a time
    for record in records:
        with torch.no_grad():
            probs = adapter.logits(test.batch([record["index"]]))[0].double().softmax(-1)
        assert record["prediction"] == int(probs.argmax())
        assert record["probability"] == pytest.approx(float(probs.max()), abs=1e-5)
        assert record["label_probability"] == pytest.approx(float(probs[record["label"]]), abs=1e-5)

    with (results / "self_influence.csv").open() as f:
        ranked = list(csv.DictReader(f))
    values = [float(r["self_influence"]) for r in ranked]
    assert len(ranked) == 12 and values == sorted(values, reverse=True)
    assert int(ranked[0]["index"]) == int(expected.self_influence.argmax())
    lines = (results / "self_influence.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["rank"] == 1 and len(lines) == 12

    saved = json.loads((results / "summary.json").read_text())
    assert saved["method"] == "closed_form" and saved["n_parameters"] == 32 * 32 + 32 + 2 * 32 + 2
    assert saved["flipped_label_auc"] is None
    assert saved["label_names"] == adapter.label_names and saved["predictions_checkpoint"] == str(project / "ckpt2.pt")
    assert saved["completions"] is None  # a classifier has labels, no completions
    events, _ = read_events(RunDir(run_dir).events)
    progress = [e for e in events if e["type"] == "progress"]
    assert progress[-1]["done"] == progress[-1]["total"] == 36 and progress[-1]["unit"] == "train gradients"
    assert {Path(e["path"]).name for e in events if e["type"] == "artifact"} == {
        "influence.jsonl",
        "self_influence.jsonl",
        "self_influence.csv",
        "dataset_ranking.jsonl",
        "dataset_ranking.csv",
        "scores.safetensors",
        "summary.json",
    }


def test_a_run_whose_gradients_all_come_from_the_cache_gives_no_compute_rate(project: Path, tmp_path: Path) -> None:
    """Reading training gradients is not computing them: the second run's rate is the cache's, named as such."""
    profile = write_profile(project, tmp_path, "train_cache = true")
    timings = []
    for name in ("first", "second"):
        run_job(load_profile(profile), context(tmp_path / name, tmp_path))
        timings.append(json.loads((tmp_path / name / "results" / "summary.json").read_text())["timing"])
    assert timings[0]["train_examples_per_s"] > 0 and "cached_examples_per_s" not in timings[0]
    assert timings[1]["train_examples_per_s"] is None and timings[1]["cached_examples_per_s"] > 0
    assert "read from the training-gradient cache" in timings[1]["note"]


def test_a_run_reports_each_stage(project: Path, tmp_path: Path) -> None:
    extra = "agreement_train = 4\ntrain_cache = true"
    run_dir = tmp_path / "run"
    run_job(load_profile(write_profile(project, tmp_path, extra)), context(run_dir, tmp_path))
    seen = stages(run_dir / "events.jsonl")
    start = [
        "loading the model",
        *hf_load_stages(),
        "reading test.jsonl",
        "tokenizing 3 examples of test.jsonl",
        "reading train.jsonl",
        "tokenizing 12 examples of train.jsonl",
        "preparing the engine",
    ]
    assert seen[: len(start)] == start
    merging, predicting = seen.index("merging the blocks' scores"), seen.index(PREDICTING)
    assert seen[predicting:] == [PREDICTING, "writing results", "checkpoint 3/3 [train gradients]"]  # the count again
    scoring = seen[len(start) : merging]
    for c in (
        1,
        2,
        3,
    ):  # each checkpoint: loaded, then its blocks through the train gradient cache and its test gradients
        at = f"checkpoint {c}/3"
        its = [name for name in scoring if name.startswith(f"{at}:") or name.startswith(f"{at} ")]
        assert its[0] == f"{at}: loading it"
        assert set(its) == {
            f"{at}: loading it",
            f"{at}: train gradient cache [train gradients]",
            f"{at}: gradients of 3 test examples",
            f"{at} [train gradients]",
        }
    assert all(name.startswith("checkpoint ") for name in scoring)
    agreement = seen[merging + 1 : predicting]  # both computations of the check say which one they are
    for prefix in (AGREEMENT_RUN, AGREEMENT_EXACT):
        assert f"{prefix}: checkpoint 1/3: loading it" in agreement
        assert f"{prefix}: checkpoint 3/3 [train gradients]" in agreement
    assert all(name.startswith((AGREEMENT_RUN, AGREEMENT_EXACT)) for name in agreement)


def profile_checkpoints(root: Path) -> list[Checkpoint]:
    return [
        Checkpoint(root / "ckpt0.safetensors", 0.3),
        Checkpoint(root / "ckpt1.safetensors", 0.2),
        Checkpoint(root / "ckpt2.pt", 0.1),
    ]


def test_resumed_run_reuses_finished_shards(project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    profile = load_profile(write_profile(project, tmp_path))
    run_dir = tmp_path / "run"
    run_job(profile, context(run_dir, tmp_path))
    first = (RunDir(run_dir).results / "influence.jsonl").read_text()
    loads: list[Path] = []
    original = Adapter.read_weights
    monkeypatch.setattr(Adapter, "read_weights", lambda self, path: loads.append(path) or original(self, path))
    run_job(profile, context(run_dir, tmp_path))
    assert loads == []  # every block's final shard was there
    assert (RunDir(run_dir).results / "influence.jsonl").read_text() == first

    changed = load_profile(write_profile(project, tmp_path, "projection_dim = 8"))
    with pytest.raises(UserError, match=r"the settings changed since the run started \(projection_dim: 0 -> 8\)"):
        run_job(changed, context(run_dir, tmp_path))


def test_a_cache_folder_that_is_a_file_leaves_the_run_going_without_it(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache-file"
    cache.write_text("a file where the cache folder should be")
    monkeypatch.setenv("GPUOPT_TUI_CACHE_DIR", str(cache))
    profile = load_profile(write_profile(project, tmp_path, "train_cache = true"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    summary = run_job(profile, JobContext(run_dir, EventWriter(RunDir(run_dir).events), cache))
    assert summary["n_scored"] == 12
    events, _ = read_events(RunDir(run_dir).events)
    warnings = [e["message"] for e in events if e["type"] == "warning"]
    assert len(warnings) == 1 and warnings[0].startswith(f"{cache / 'tracin-gradients'}: cannot store")
    assert "train_cache = false" in warnings[0]


def _rewrite_last_checkpoint(root: Path) -> None:
    """Other weights in ckpt2.pt, at the same path."""
    state = torch.load(root / "ckpt2.pt")
    torch.save({k: v + 0.01 for k, v in state.items()}, root / "ckpt2.pt")


def _change_training_texts(root: Path) -> None:
    rows = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines()]
    (root / "train.jsonl").write_text("".join(json.dumps({**r, "text": "w1 " + r["text"]}) + "\n" for r in rows))


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (_rewrite_last_checkpoint, r"the checkpoints changed since the run started \(tracin.checkpoints\)"),
        (_change_training_texts, r"the data changed since the run started \(.*train.jsonl, .*test.jsonl\)"),
    ],
)
def test_resume_refuses_shards_made_from_other_checkpoints_or_data(
    project: Path, tmp_path: Path, change: Callable[[Path], None], refusal: str
) -> None:
    root = tmp_path / "project"
    shutil.copytree(project, root)
    profile = load_profile(write_profile(root, tmp_path))
    run_dir = tmp_path / "run"
    run_job(profile, context(run_dir, tmp_path))
    change(root)
    with pytest.raises(UserError, match=rf"^resume refused: {refusal}: start a new run$"):
        run_job(profile, context(run_dir, tmp_path))


def test_a_run_stopped_in_its_final_merge_resumes_with_its_batch_size_and_rate(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    profile = load_profile(write_profile(project, tmp_path))
    run_dir = tmp_path / "run"
    merge = TracInRun.gather

    def killed(self: TracInRun, rank_stats: Any) -> Any:
        raise KeyboardInterrupt  # as a kill while every block's shard is saved and the merge goes on

    monkeypatch.setattr(TracInRun, "gather", killed)
    with pytest.raises(KeyboardInterrupt):
        run_job(profile, context(run_dir, tmp_path))
    monkeypatch.setattr(TracInRun, "gather", merge)
    summary = run_job(profile, context(run_dir, tmp_path))
    saved = json.loads((RunDir(run_dir).results / "summary.json").read_text())
    assert saved["final_batch_size"] > 0 and saved["timing"]["train_examples_per_s"] > 0
    assert summary["train_examples_per_s"] == saved["timing"]["train_examples_per_s"]
    assert "no training gradient was computed by this attempt" in saved["timing"]["note"]

    fresh = run_job(profile, context(tmp_path / "fresh", tmp_path))  # an attempt that computes: no note
    assert "note" not in json.loads((tmp_path / "fresh" / "results" / "summary.json").read_text())["timing"]
    assert fresh["train_examples_per_s"] > 0


def test_matrix_is_left_out_above_save_matrix_max(project: Path, tmp_path: Path) -> None:
    profile = load_profile(write_profile(project, tmp_path, "save_matrix_max = 35"))
    run_job(profile, context(tmp_path / "run", tmp_path))
    assert not (tmp_path / "run" / "results" / "scores.safetensors").exists()
    assert (tmp_path / "run" / "results" / "self_influence.csv").exists()


@pytest.mark.parametrize(
    ("checkpoints", "message"),
    [
        ('{ path = "/nonexistent/c.safetensors", lr = 0.1 }', r"tracin.checkpoints\[0\]: /nonexistent/c.safetensors"),
        ("BROKEN", "cannot read the checkpoint"),
        ('{ path = "ROOT/ckpt0.safetensors", lr = 0.0 }', "every learning rate is 0"),
    ],
)
def test_bad_checkpoints_are_user_errors(project: Path, tmp_path: Path, checkpoints: str, message: str) -> None:
    if checkpoints == "BROKEN":
        broken = tmp_path / "broken.safetensors"
        broken.write_bytes(b"not a checkpoint")
        checkpoints = f'{{ path = "{broken}", lr = 0.1 }}'
    profile = load_profile(write_profile(project, tmp_path, checkpoints=checkpoints.replace("ROOT", str(project))))
    with pytest.raises(UserError, match=message):
        run_job(profile, context(tmp_path / "run", tmp_path))


def test_fitting_pca_directions_is_timed_apart_from_the_scoring_rate(project: Path, tmp_path: Path) -> None:
    """Fitting the projection is a fixed cost per checkpoint: the summary gives its seconds, and the rate of
    training examples a second is over the rest of the computing."""
    extra = 'method = "factored"\nprojection_in = 2\nprojection_out = 2\nprojection_basis = "pca"\npca_examples = 6'
    outcome = run_job(load_profile(write_profile(project, tmp_path, extra)), context(tmp_path / "run", tmp_path))
    summary = json.loads((tmp_path / "run" / "results" / "summary.json").read_text())
    timing = summary["timing"]
    fitting, seconds = timing["projection_fit_seconds"], timing["compute_seconds"]
    assert 0 < fitting < seconds
    assert timing["train_examples_per_s"] == pytest.approx(summary["n_scored"] / (seconds - fitting))
    assert outcome["projection_fit_seconds"] == fitting  # the CLI's outcome lines say it too
