"""Users' data files (JSONL and CSV), damaged at random, read and tokenized as a run reads them: a dataset,
or a message naming the file (and the line, where there is one); never another exception; the file is never
written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.common import DataSection
from gpuopt_tui.jobs.data import load_dataset
from gpuopt_tui.jobs.models.base import Adapter
from gpuopt_tui.jobs.models.hf import load_hf_adapter

from .inputs import FUZZ, JSON_VALUES, damaged, unchanged

ROWS = [{"text": "the cat sat", "label": 1}, {"text": "good", "label": 0}, {"text": "not bad", "label": 2}]
GOOD_JSONL = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
GOOD_CSV = ("text,label\n" + "".join(f'"{r["text"]}",{r["label"]}\n' for r in ROWS)).encode()


@pytest.fixture(scope="module")
def adapter(tiny_bert_dir: Path) -> Adapter:
    return load_hf_adapter(tiny_bert_dir, torch.device("cpu"))


def check_load(path: Path, adapter: Adapter) -> None:
    def load() -> None:
        try:
            load_dataset(DataSection(source=path.suffix[1:], path=str(path)), adapter)
        except UserError as error:
            message = str(error)
            assert message.startswith(str(path)), message
            assert "\x1b" not in message and "\x07" not in message, message
            assert len(message) < len(str(path)) + 600, message  # quotes a value, never a whole file

    unchanged(path, load)


@FUZZ
@given(data=st.data())
def test_damaged_data_files(scratch: Path, adapter: Adapter, data: st.DataObject) -> None:
    suffix, good = data.draw(st.sampled_from([(".jsonl", GOOD_JSONL), (".csv", GOOD_CSV)]))
    path = scratch / f"data{suffix}"
    path.write_bytes(data.draw(damaged(good)))
    check_load(path, adapter)


@FUZZ
@given(data=st.data())
def test_jsonl_rows_with_values_of_any_type(scratch: Path, adapter: Adapter, data: st.DataObject) -> None:
    rows = [dict(r) for r in ROWS]
    for _ in range(data.draw(st.integers(1, 3))):
        row = data.draw(st.sampled_from(rows))
        row[data.draw(st.sampled_from(["text", "label", "other"]))] = data.draw(JSON_VALUES)
    path = scratch / "typed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    check_load(path, adapter)
