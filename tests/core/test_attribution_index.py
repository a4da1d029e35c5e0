"""attributions.index.jsonl, written with attributions.jsonl: read instead of the jsonl when it is valid for the
jsonl as it is, giving the entries a full read gives; missing, stale, cut short or damaged, it is not used and the
jsonl is read whole."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from gpuopt_tui.core.results.attribution import (
    ENTRY_FIELDS,
    JSONL_NAME,
    SampleEntry,
    SampleIndex,
    write_samples,
)
from gpuopt_tui.core.results.attribution_index import index_path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "runs"
CLASSIFIER = next((FIXTURES / "attribution").iterdir()) / "results" / JSONL_NAME
CAUSAL_LM = next((FIXTURES / "attribution-lm").iterdir()) / "results" / JSONL_NAME


def fixture_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def written(tmp_path: Path, records: list[dict[str, Any]]) -> Path:
    path = tmp_path / JSONL_NAME
    write_samples(path, records)
    return path


def assert_read_whole(path: Path) -> SampleIndex:
    """The index file is not used, and what is shown is what a full read of the jsonl gives."""
    index, scan = SampleIndex.build(path), SampleIndex.scan(path)
    assert index is not None and scan is not None
    assert index.index_file is None
    assert (index.entries, index.corrupt, index.too_long) == (scan.entries, scan.corrupt, scan.too_long)
    return index


@pytest.mark.parametrize("source", [CLASSIFIER, CAUSAL_LM], ids=["classifier", "causal-lm"])
def test_a_valid_index_gives_the_entries_of_a_full_read(tmp_path: Path, source: Path) -> None:
    path = written(tmp_path, fixture_records(source))
    assert path.read_bytes() == source.read_bytes()  # the writer writes the lines the job always wrote
    index, scan = SampleIndex.build(path), SampleIndex.scan(path)
    assert index is not None and scan is not None
    assert index.index_file == index_path(path) == tmp_path / "attributions.index.jsonl"
    assert index.entries == scan.entries and len(index) == len(fixture_records(source))
    assert (index.corrupt, index.too_long) == (0, 0)
    for entry in index.entries:  # a sample is read from its offset, as after a full read
        assert index.read(entry).segments == scan.read(entry).segments


def test_every_field_of_an_entry_is_in_the_index(tmp_path: Path) -> None:
    path = written(tmp_path, fixture_records(CAUSAL_LM))
    header = json.loads(index_path(path).read_bytes().splitlines()[0])
    assert header["fields"] == list(ENTRY_FIELDS)
    assert set(ENTRY_FIELDS) | {"offset"} == set(SampleEntry.__dataclass_fields__)
    entry = SampleIndex.build(path).entries[0]  # type: ignore[union-attr]
    assert entry.completion is not None and entry.logprob is not None and entry.steps is not None


def test_lines_that_are_not_samples_are_counted_in_the_index(tmp_path: Path) -> None:
    records = fixture_records(CLASSIFIER)
    path = written(tmp_path, [records[0], {"index": 99, "text": "no scores"}, *records[1:]])
    index = SampleIndex.build(path)
    assert index is not None and index.index_file is not None
    assert index.corrupt == 1 and [e.index for e in index.entries] == [r["index"] for r in records]
    assert index.entries == SampleIndex.scan(path).entries  # type: ignore[union-attr]


def test_an_index_of_no_samples_is_used(tmp_path: Path) -> None:
    path = written(tmp_path, [{"index": 0, "text": "no scores"}])
    index = SampleIndex.build(path)
    assert index is not None and index.index_file is not None and (len(index), index.corrupt) == (0, 1)


def test_a_missing_index_reads_the_jsonl(tmp_path: Path) -> None:
    path = tmp_path / JSONL_NAME
    shutil.copy(CLASSIFIER, path)  # a run of an earlier version
    assert len(assert_read_whole(path)) == len(fixture_records(CLASSIFIER))


def test_an_index_of_a_jsonl_written_again_is_not_used(tmp_path: Path) -> None:
    records = fixture_records(CLASSIFIER)
    path = written(tmp_path, records)
    stale = index_path(path).read_bytes()
    write_samples(path, list(reversed(records)))  # as a resumed run writes it again
    index_path(path).write_bytes(stale)
    assert [e.index for e in assert_read_whole(path).entries] == [r["index"] for r in reversed(records)]


def test_a_jsonl_changed_in_place_is_read_whole(tmp_path: Path) -> None:
    """Same size and same first and last bytes, or same bytes and size with a new mtime: the stamp differs."""
    records = fixture_records(CLASSIFIER)
    path = written(tmp_path, records)
    data = path.read_bytes()
    middle = len(data) // 2
    swapped = data[:middle] + data[middle:].replace(b'"prediction": 0', b'"prediction": 1', 1)
    assert len(swapped) == len(data) and swapped != data
    path.write_bytes(swapped)
    assert_read_whole(path)
    path.write_bytes(data)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert_read_whole(path)
    write_samples(path, records)
    assert SampleIndex.build(path).index_file is not None  # type: ignore[union-attr]


def test_an_index_of_another_jsonl_is_not_used(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    path = written(tmp_path / "a", fixture_records(CLASSIFIER))
    other = written(tmp_path, fixture_records(CAUSAL_LM))
    shutil.copy(index_path(path), index_path(other))
    assert_read_whole(other)


def digest_line(body: bytes) -> bytes:
    return json.dumps({"sha256": hashlib.sha256(body).hexdigest()}).encode() + b"\n"


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) // 2],  # cut short
        lambda data: data[:-1],  # its last newline cut
        lambda data: b"",
        lambda data: b"\x00\xff garbage \n" * 40,
        lambda data: data.replace(b"0.", b"0.1", 1),  # a value changed: the digest says so
        lambda data: data.replace(b"\n", b"\n\n", 1),
    ],
    ids=["half", "newline", "empty", "garbage", "value", "blank-line"],
)
def test_a_damaged_index_is_not_used(tmp_path: Path, damage: Any) -> None:
    path = written(tmp_path, fixture_records(CAUSAL_LM))
    data = index_path(path).read_bytes()
    index_path(path).write_bytes(damage(data))
    assert_read_whole(path)


@pytest.mark.parametrize(
    "edit",
    [
        lambda header, rows: (header | {"format": "gpuopt-tui-attributions-index-0"}, rows),
        lambda header, rows: (header | {"fields": header["fields"][:-1]}, rows),
        lambda header, rows: (header | {"corrupt": -1}, rows),
        lambda header, rows: (header, [[*rows[0][:2], "0", *rows[0][3:]], *rows[1:]]),  # index as a string
        lambda header, rows: (header, [[*rows[0][:9], [1], *rows[0][10:]], *rows[1:]]),  # top_tokens not strs
        lambda header, rows: (header, [rows[1], rows[0], *rows[2:]]),  # offsets out of order
        lambda header, rows: (header, [*rows[:-1], [rows[-1][0], rows[-1][1] + 1, *rows[-1][2:]]]),  # past the end
        lambda header, rows: (header, [rows[0][:-1], *rows[1:]]),  # a value missing
    ],
    ids=["format", "fields", "count", "type", "top-tokens", "order", "length", "short-row"],
)
def test_an_index_of_another_writer_is_not_used(tmp_path: Path, edit: Any) -> None:
    """Whole (its digest matches) but not what this version writes: not used."""
    path = written(tmp_path, fixture_records(CAUSAL_LM))
    header, *rows = (json.loads(line) for line in index_path(path).read_bytes().splitlines()[:-1])
    header, rows = edit(header, rows)
    body = b"".join(json.dumps(item).encode() + b"\n" for item in [header, *rows])
    index_path(path).write_bytes(body + digest_line(body))
    assert_read_whole(path)


def test_an_index_rewritten_with_its_digest_is_used(tmp_path: Path) -> None:
    """The check above rests on the edit alone: the same lines written back are used."""
    path = written(tmp_path, fixture_records(CAUSAL_LM))
    lines = index_path(path).read_bytes().splitlines()[:-1]
    body = b"".join(json.dumps(json.loads(line)).encode() + b"\n" for line in lines)
    index_path(path).write_bytes(body + digest_line(body))
    assert SampleIndex.build(path).index_file is not None  # type: ignore[union-attr]


def test_an_index_larger_than_its_jsonl_allows_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = written(tmp_path, fixture_records(CLASSIFIER))
    monkeypatch.setattr("gpuopt_tui.core.results.attribution_index.INDEX_SLACK_BYTES", 0)
    monkeypatch.setattr("gpuopt_tui.core.results.attribution_index.MAX_INDEX_RATIO", 0.25)
    assert index_path(path).stat().st_size > path.stat().st_size / 4
    assert_read_whole(path)


def test_writing_again_removes_an_earlier_index_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An index that cannot be written leaves no index of the earlier file behind, and says so: the jsonl stands."""
    records = fixture_records(CLASSIFIER)
    path = written(tmp_path, records)

    def fail(*_: Any, **__: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("gpuopt_tui.core.results.attribution.write_index", fail)
    note = write_samples(path, records[:3])
    assert note is not None and "disk full" in note and "attributions.index.jsonl was not written" in note
    assert not index_path(path).exists()
    assert len(assert_read_whole(path)) == 3
