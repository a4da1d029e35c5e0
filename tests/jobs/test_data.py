"""Datasets: jsonl/csv loading and its errors, length bucketing and trimming."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.common import DataSection
from gpuopt_tui.jobs.data import (
    TextDataset,
    batches,
    cut_texts_note,
    length_sorted_order,
    load_dataset,
    trim_batch,
)
from gpuopt_tui.jobs.models.base import Adapter
from gpuopt_tui.jobs.models.hf import load_hf_adapter

TEXTS = [
    "the cat sat",
    "a big red dog ran under the blue moon and the sun",
    "good",
    "the quick dog jumps over",  # "over" is not in the vocabulary: [UNK]
    "very happy",
    "rain and snow on the hill with the river under the tree",
    "not bad",
]


@pytest.fixture(scope="module")
def adapter(tiny_bert_dir: Path) -> Adapter:
    return load_hf_adapter(tiny_bert_dir, torch.device("cpu"))


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def jsonl_section(path: Path, **kw) -> DataSection:
    return DataSection(source="jsonl", path=str(path), **kw)


def test_jsonl_texts_and_labels(tmp_path: Path, adapter: Adapter) -> None:
    rows = [{"text": t, "label": i % 3, "extra": [1]} for i, t in enumerate(TEXTS)]
    path = write_jsonl(tmp_path / "d.jsonl", [rows[0], "", *rows[1:]])  # blank lines are skipped
    ds = load_dataset(jsonl_section(path), adapter)
    assert len(ds) == len(TEXTS) and ds.texts == TEXTS
    assert ds.labels.tolist() == [i % 3 for i in range(len(TEXTS))]
    expected = adapter.tokenize(TEXTS, 128)
    assert torch.equal(ds.tensors["input_ids"], expected["input_ids"])
    assert torch.equal(ds.tensors["attention_mask"], expected["attention_mask"])
    assert ds.token_fields == {"input_ids": "attention_mask"}
    assert ds.origin == str(path)


def test_csv_with_other_field_names_and_no_labels(tmp_path: Path, adapter: Adapter) -> None:
    path = tmp_path / "d.csv"
    path.write_text('review,stars\n"the cat, sat",2\ngood,0\n')
    ds = load_dataset(DataSection(source="csv", path=str(path), text_field="review", label_field="stars"), adapter)
    assert ds.texts == ["the cat, sat", "good"] and ds.labels.tolist() == [2, 0]
    unlabeled = load_dataset(DataSection(source="csv", path=str(path), text_field="review"), adapter)
    assert unlabeled.labels is None and "labels" not in unlabeled.tensors


def test_max_length_truncates(tmp_path: Path, adapter: Adapter) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS])
    ds = load_dataset(jsonl_section(path, max_length=6), adapter)
    assert ds.tensors["input_ids"].shape == (len(TEXTS), 6)
    note = cut_texts_note(ds, jsonl_section(path, max_length=6), adapter)
    assert note is not None and note.startswith("3 of 7 texts")  # 14, 7 and 14 tokens
    assert "6-token limit (data.max_length; the model takes up to 64)" in note
    positions = jsonl_section(path, max_length=1000)  # above the tiny model's 64 positions: none is cut
    assert cut_texts_note(load_dataset(positions, adapter), positions, adapter) is None


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"text": "a", "label": 1}', "{broken"], r"d\.jsonl:2: not valid JSON"),
        (['{"text": "a"}', "[1, 2]"], r"d\.jsonl:2: expected a JSON object per line, got list"),
        (
            ['{"text": "a", "label": 0}', '{"body": "b", "label": 1}'],
            r'd\.jsonl:2: missing key "text" \(have: body, label\)',
        ),
        (['{"text": 5}'], r'd\.jsonl:1: "text" must be a string, got int'),
        (['{"text": "a", "label": "one"}'], r"d\.jsonl:1: label \"label\" must be an integer class index, got 'one'"),
        (['{"text": "a", "label": 1.5}'], r'd\.jsonl:1: label "label" must be an integer class index, got 1\.5'),
        (['{"text": "a", "label": true}'], r'd\.jsonl:1: label "label" must be an integer'),
        (['{"text": "a", "label": 3}'], r'd\.jsonl:1: label "label" = 3 is outside 0\.\.2'),
        (['{"text": "a", "label": 1}', '{"text": "b"}'], r'd\.jsonl:2: missing label "label"'),
        ([""], r"d\.jsonl: no examples in the file"),
    ],
)
def test_jsonl_errors_name_file_line_and_key(tmp_path: Path, adapter: Adapter, lines, message) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", lines)
    with pytest.raises(UserError, match=message):
        load_dataset(jsonl_section(path), adapter)


def test_csv_errors(tmp_path: Path, adapter: Adapter) -> None:
    path = tmp_path / "d.csv"
    path.write_text("text,label\na,1\nb,x\n")
    with pytest.raises(UserError, match=r'd\.csv:3: label "label" must be an integer class index, got \'x\''):
        load_dataset(DataSection(source="csv", path=str(path)), adapter)
    path.write_text("body,label\na,1\n")
    with pytest.raises(UserError, match=r'd\.csv:2: missing key "text"'):
        load_dataset(DataSection(source="csv", path=str(path)), adapter)
    path.write_text("")
    with pytest.raises(UserError, match=r"d\.csv: empty CSV file"):
        load_dataset(DataSection(source="csv", path=str(path)), adapter)


def test_missing_file_and_path_override(tmp_path: Path, adapter: Adapter) -> None:
    with pytest.raises(UserError, match=r"nowhere\.jsonl: data file not found"):
        load_dataset(jsonl_section(tmp_path / "nowhere.jsonl"), adapter)
    train = tmp_path / "train.csv"
    train.write_text("text,label\nthe cat,1\n")
    ds = load_dataset(jsonl_section(tmp_path / "test.jsonl"), adapter, path=train)  # format from the extension
    assert ds.texts == ["the cat"]
    with pytest.raises(UserError, match=r"train\.txt: cannot tell the format"):
        load_dataset(DataSection(), adapter, path=tmp_path / "train.txt")


def test_demo_source_needs_a_demo_model(adapter: Adapter) -> None:
    with pytest.raises(UserError, match="needs model adapter = demo"):
        load_dataset(DataSection(source="demo"), adapter)


def dataset(adapter: Adapter) -> TextDataset:
    tensors = adapter.tokenize(TEXTS, 128)
    tensors["labels"] = torch.arange(len(TEXTS)) % 3
    return TextDataset(tensors, list(TEXTS), dict(adapter.token_fields), "test")


def test_length_sorted_order(adapter: Adapter) -> None:
    ds = dataset(adapter)
    lengths = ds.lengths().tolist()
    assert lengths == [5, 14, 3, 7, 4, 14, 4]
    order = length_sorted_order(ds)
    assert order == [1, 5, 3, 0, 4, 6, 2]  # longest first, ties keep dataset order
    assert length_sorted_order(ds, descending=False) == [2, 4, 6, 0, 3, 1, 5]


def test_prompt_and_completion_count_together_in_the_order() -> None:
    """A causal LM runs [prompt | completion] as one sequence: batches are sorted by both parts' tokens (a short
    prompt with a long completion is a long row), while `lengths` stays the prompt's (the attributed field's)."""

    def masks(lengths: list[int]) -> torch.Tensor:
        return (torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]).long()

    prompt, completion = masks([9, 2, 5, 3]), masks([1, 12, 5, 2])
    tensors = {
        "input_ids": prompt,
        "attention_mask": prompt,
        "completion_ids": completion,
        "completion_mask": completion,
    }
    fields = {"input_ids": "attention_mask", "completion_ids": "completion_mask"}
    ds = TextDataset(tensors, ["a", "b", "c", "d"], fields, "test")
    assert ds.lengths().tolist() == [9, 2, 5, 3] and ds.tokens().tolist() == [10, 14, 10, 5]
    assert length_sorted_order(ds) == [1, 0, 2, 3]


def test_bucketed_trimmed_batches_give_the_padded_logits(adapter: Adapter) -> None:
    ds = dataset(adapter)
    with torch.no_grad():
        padded = adapter.logits(ds.tensors)
        seen, widths = [], []
        for idx, batch in batches(ds, 3, length_sorted_order(ds)):
            widths.append(batch["input_ids"].shape[1])
            assert batch["attention_mask"][:, -1].any()  # no all-padding column is left
            torch.testing.assert_close(adapter.logits(batch), padded[idx], rtol=1e-5, atol=1e-5)
            assert torch.equal(batch["labels"], ds.labels[idx])
            seen += idx
    assert sorted(seen) == list(range(len(ds)))
    assert widths == [14, 5, 3]
    untrimmed = [b["input_ids"].shape[1] for _, b in batches(ds, 3, trim=False)]
    assert untrimmed == [14, 14, 14]


def test_trim_batch_cuts_each_field_by_its_own_mask() -> None:
    mask = torch.tensor([[[1, 1, 0, 0], [1, 0, 0, 0]], [[1, 1, 1, 0], [0, 0, 0, 0]]])
    history_mask = torch.tensor([[[1, 1, 1, 1, 1]], [[1, 0, 0, 0, 0]]])
    batch = {
        "input_ids": mask * 7,
        "attention_mask": mask,
        "history_ids": history_mask * 9,
        "history_mask": history_mask,
        "labels": torch.tensor([0, 1]),
    }
    fields = {"input_ids": "attention_mask", "history_ids": "history_mask"}
    out = trim_batch(batch, fields)
    assert out["input_ids"].shape == (2, 2, 3) and out["attention_mask"].shape == (2, 2, 3)
    assert out["history_ids"].shape == (2, 1, 5)
    assert torch.equal(out["labels"], batch["labels"])
    assert torch.equal(out["input_ids"], batch["input_ids"][..., :3])


def test_trim_batch_keeps_every_real_token_of_left_padded_rows() -> None:
    mask = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 0]])
    batch = {"input_ids": torch.arange(12).reshape(2, 6), "attention_mask": mask}
    out = trim_batch(batch, {"input_ids": "attention_mask"})
    assert torch.equal(out["attention_mask"], mask[:, 2:5])
    assert torch.equal(out["input_ids"], batch["input_ids"][:, 2:5])


def test_subset_and_head(adapter: Adapter) -> None:
    ds = dataset(adapter)
    sub = ds.subset([4, 0])
    assert sub.texts == [TEXTS[4], TEXTS[0]]
    assert torch.equal(sub.tensors["input_ids"], ds.tensors["input_ids"][[4, 0]])
    assert len(ds.head(2)) == 2 and ds.head(0) is ds and ds.head(100) is ds
    with pytest.raises(ValueError, match="differ in length"):
        TextDataset({"input_ids": torch.zeros(2, 3)}, ["a"], {}, "x")
