"""A stopped run's resume record and shards, damaged or mixed with another run's at random, then resumed: the
run refuses with a one-line message that names what is wrong, or makes again what it cannot trust and ends with
the results of a run never stopped; it never uses a wrong shard and never fails otherwise. Each resume is bounded
in time."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.io import profile_from_data
from gpuopt_tui.core.runs.events import EventWriter
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.jobs.attribution.job import run_job
from gpuopt_tui.jobs.context import CHECKSUMS, RESUME_RECORD, JobCancelled, JobContext, ResumePart

from .inputs import EXAMPLES, FUZZ, JSON_VALUES, damaged

N_TEXTS, BATCH = 8, 2
SECONDS_PER_RESUME = 20  # a resume of this tiny run takes about a second on a busy machine; a hang would not
STOPPED_AFTER = 2  # shards
RESULTS = ("attributions.jsonl", "summary.json")


class StopAfterTwoShards(JobContext):
    def save_shard(self, name: str, write: Any) -> Path:
        path = super().save_shard(name, write)
        if name.startswith("batch_") and len(self.finished_shards()) >= STOPPED_AFTER:
            self.request_cancel()
        return path


def attribution(root: Path, model: Path, data: str) -> Any:
    return profile_from_data(
        {
            "kind": "attribution",
            "run": {"device": "cpu"},
            "model": {"adapter": "hf", "path": str(model)},
            "data": {"source": "jsonl", "path": str(root / data), "max_length": 16},
            "attribution": {"n_steps": 4, "method": "riemann_middle", "batch_size": BATCH, "length_bucketing": False},
        },
        "fuzz.toml",
    )


def context(run_dir: Path, cls: type[JobContext] = JobContext) -> JobContext:
    run_dir.mkdir(parents=True, exist_ok=True)
    return cls(run_dir, EventWriter(RunDir(run_dir).events), run_dir.parent / "cache")


def results(run_dir: Path) -> list[str]:
    lines = (RunDir(run_dir).results / RESULTS[0]).read_text().splitlines()
    summary = json.loads((RunDir(run_dir).results / RESULTS[1]).read_text())
    return [*lines, json.dumps({k: summary[k] for k in ("n_samples", "deltas", "top_k")})]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_bert_dir: Path, tiny_words: list[str]) -> dict[str, Any]:
    """A run never stopped (the expected results), one stopped after two shards, and one of other texts stopped
    alike (whose shards must never be taken for the first's)."""
    root = tmp_path_factory.mktemp("resume")
    texts = [" ".join(tiny_words[i : i + 2 + i % 4]) for i in range(N_TEXTS)]
    for name, prefix in (("data.jsonl", ""), ("other.jsonl", "the ")):
        lines = [json.dumps({"text": prefix + t, "label": i % 3}) for i, t in enumerate(texts)]
        (root / name).write_text("\n".join(lines) + "\n")
    run_job(attribution(root, tiny_bert_dir, "data.jsonl"), context(root / "whole"))
    for name, data in (("stopped", "data.jsonl"), ("other", "other.jsonl")):
        with pytest.raises(JobCancelled):
            run_job(attribution(root, tiny_bert_dir, data), context(root / name, StopAfterTwoShards))
    return {"root": root, "model": tiny_bert_dir, "expected": results(root / "whole")}


DAMAGES = (
    "record_bytes",
    "record_value",
    "record_gone",
    "shard_bytes",
    "shards_swapped",
    "shards_and_checksums_swapped",
    "foreign_shard",
    "checksum_bytes",
    "checksum_gone",
)


def damage(draw: st.DrawFn, kind: str, state: Path, other: Path) -> None:
    record = state / RESUME_RECORD
    shard = draw(st.sampled_from([f"batch_{j:05d}.safetensors" for j in range(STOPPED_AFTER)]))
    checksum = state / CHECKSUMS / f"{shard}.json"
    if kind == "record_bytes":
        record.write_bytes(draw(damaged(record.read_bytes())))
    elif kind == "record_value":
        data = json.loads(record.read_text())
        data[draw(st.sampled_from([*data, "extra"]))] = draw(JSON_VALUES)
        record.write_text(json.dumps(data))
    elif kind == "record_gone":
        record.unlink()
    elif kind == "shard_bytes":
        (state / shard).write_bytes(draw(damaged((state / shard).read_bytes())))
    elif kind.startswith("shards"):
        names = ["batch_00000.safetensors", "batch_00001.safetensors"]
        folders = [state, state / CHECKSUMS] if kind == "shards_and_checksums_swapped" else [state]
        for folder in folders:
            suffix = ".json" if folder.name == CHECKSUMS else ""
            a, b = (folder / f"{n}{suffix}" for n in names)
            a.rename(folder / "swap")
            b.rename(a)
            (folder / "swap").rename(b)
    elif kind == "foreign_shard":
        shutil.copy(other / shard, state / shard)
        shutil.copy(other / CHECKSUMS / f"{shard}.json", checksum)
    elif kind == "checksum_bytes":
        checksum.write_bytes(draw(damaged(checksum.read_bytes())))
    else:
        checksum.unlink()


@settings(FUZZ, max_examples=EXAMPLES * 3 // 4)  # each example is a resumed run
@given(data=st.data())
def test_a_damaged_or_mixed_state_is_refused_or_made_again(runs: dict[str, Any], data: st.DataObject) -> None:
    root = runs["root"]
    run_dir = root / "fuzzed"
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(root / "stopped", run_dir)
    kind = data.draw(st.sampled_from(DAMAGES))
    damage(data.draw, kind, RunDir(run_dir).state, RunDir(root / "other").state)
    start = time.monotonic()
    try:
        run_job(attribution(root, runs["model"], "data.jsonl"), context(run_dir))
    except UserError as refused:
        message = str(refused)
        assert kind.startswith("record_"), (kind, message)  # only a record that says something else is refused
        assert message.startswith("resume refused: ") and message.endswith(": start a new run"), message
        assert "\n" not in message and "\x1b" not in message and len(message) < 600, message
        assert not (RunDir(run_dir).results / RESULTS[0]).exists()
    else:
        assert results(run_dir) == runs["expected"], kind  # every shard it used was the run's own
    assert time.monotonic() - start < SECONDS_PER_RESUME


RECORD = {
    "data": ResumePart("9f" * 32, "the data", "data.path d.jsonl"),
    "settings": ResumePart({"n_steps": 50, "method": "riemann", "batches": [[0, 1], [2]]}, "the settings"),
}


@FUZZ
@given(data=st.data())
def test_a_damaged_resume_record_is_refused_with_one_line(tmp_path_factory: pytest.TempPathFactory, data: Any) -> None:
    """Fast, at the level of the record alone: damaged bytes are accepted only when they still say the same."""
    run_dir = tmp_path_factory.mktemp("record")
    ctx = JobContext(run_dir, EventWriter(run_dir / "events.jsonl"), run_dir / "cache")
    ctx.check_resume_record(RECORD)
    path = ctx.shard_path(RESUME_RECORD)
    path.write_bytes(data.draw(damaged(path.read_bytes())))
    try:
        same = json.loads(path.read_bytes()) == json.loads(json.dumps({k: p.value for k, p in RECORD.items()}))
    except (ValueError, RecursionError):
        same = False
    try:
        ctx.check_resume_record(RECORD)
    except UserError as refused:
        message = str(refused)
        assert not same and message.startswith("resume refused: ") and message.endswith(": start a new run")
        assert "\n" not in message and "\x1b" not in message and len(message) < 600, message
    else:
        assert same
