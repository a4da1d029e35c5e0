"""Users' data files that are damaged or unusual: a clear message naming the file and line, or the data read
as it is meant (quoted CSV fields over several lines, line separators inside JSON strings)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.common import DataSection
from gpuopt_tui.jobs.data import load_dataset, read_csv, read_jsonl
from gpuopt_tui.jobs.models.base import Adapter
from gpuopt_tui.jobs.models.hf import load_hf_adapter


@pytest.fixture(scope="module")
def adapter(tiny_bert_dir: Path) -> Adapter:
    return load_hf_adapter(tiny_bert_dir, torch.device("cpu"))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"text": "a"}\n' + b"[" * 100_000 + b"\n", r"d\.jsonl:2: not valid JSON \(nested too deeply\)"),
        (b'{"text": "a", "label": ' + b"1" * 5000 + b"}\n", r"d\.jsonl:1: not valid JSON \(.*digits"),
        (b'{"text": "a"}\n\xff\xfe\n', r"d\.jsonl: cannot read the data file"),
        (b'{"\\u001b[31m": "a"}\n', r'd\.jsonl:1: missing key "text" \(have: \?\[31m\)$'),
        (b'{"text": "a", "label": "--5"}\n', r"d\.jsonl:1: label \"label\" must be an integer class index, got '--5'"),
        (b'{"text": "a", "label": "\xc2\xb2"}\n', r"d\.jsonl:1: label \"label\" must be an integer class index"),
        (b'{"text": "a", "label": "' + b"x" * 5000 + b'"}\n', r"got 'x+…$"),
    ],
)
def test_bad_jsonl_is_a_clear_message(tmp_path: Path, adapter: Adapter, content: bytes, message: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(content)
    with pytest.raises(UserError, match=message) as error:
        load_dataset(DataSection(source="jsonl", path=str(path)), adapter)
    assert "\x1b" not in str(error.value)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('text,label\n"a' + "x" * 200_000 + '",1\n', r"d\.csv:\d+: not valid CSV \(field larger than field limit"),
        ("text,label\na,1\nb,\x1b[2J\n", r"d\.csv:3: label \"label\" must be an integer class index, got '\\x1b\[2J'"),
    ],
)
def test_bad_csv_is_a_clear_message(tmp_path: Path, adapter: Adapter, content: str, message: str) -> None:
    path = tmp_path / "d.csv"
    path.write_text(content)
    with pytest.raises(UserError, match=message):
        load_dataset(DataSection(source="csv", path=str(path)), adapter)


def test_a_quoted_csv_field_may_span_lines_and_rows_keep_their_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    path.write_text('text,label\n"the cat\nsat",1\ngood,0\n')
    rows = read_csv(path)
    assert [record["text"] for _, record in rows] == ["the cat\nsat", "good"]
    assert [where for where, _ in rows] == [f"{path}:3", f"{path}:4"]


def test_a_line_separator_inside_a_json_string_does_not_split_the_line(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a\u2028b\u000bc"}\n{"text": "d"}\n'.replace("\u000b", "\\u000b"), encoding="utf-8")
    rows = read_jsonl(path)
    assert [record["text"] for _, record in rows] == ["a\u2028b\u000bc", "d"]
    assert rows[1][0] == f"{path}:2"
