"""The result files of a TracIn run (written by jobs/tracin/job.py), read without torch by the TUI.

- influence.jsonl: one line per test example: index, text, label, the model's prediction at the last checkpoint
  with its probability and the label's (absent from older runs), and its `proponents` and `opponents`
  (training index, score, text, label), strongest first. A causal LM's examples add `completion` (`text` is the
  prompt), and each test example its `completion_loss`.
- self_influence.jsonl, and the same rows in self_influence.csv: every scored training example ranked by
  self-influence, highest first; `flipped` only where the data marks deliberately flipped labels (the demo).
- dataset_ranking.jsonl, and the same rows in dataset_ranking.csv: every scored training example ranked by its mean
  influence over the test examples, highest first, with its max influence over them (absent from older runs).
- summary.json: settings, timing and summary figures (core/results/tracin_summary.py reads it).

The two row files can hold millions of rows, so they are read lazily: `PagedRecords` scans a file once for
where its records start (keeping every STRIDE-th offset) and then reads any page by seeking there.
"""

from __future__ import annotations

import csv
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Generic, TypeVar

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.results.record_fields import (
    RecordError,
    as_flag,
    as_float,
    as_int,
    as_label,
    as_optional_float,
    as_text,
    get_field,
)
from gpuopt_tui.core.results.tracin_summary import TracInSummary, read_summary
from gpuopt_tui.core.runs.layout import RunDir

INFLUENCE_NAME = "influence.jsonl"
SELF_JSONL_NAME = "self_influence.jsonl"
SELF_CSV_NAME = "self_influence.csv"
DATASET_JSONL_NAME = "dataset_ranking.jsonl"
DATASET_CSV_NAME = "dataset_ranking.csv"
MATRIX_NAME = "scores.safetensors"
SUMMARY_NAME = RunDir.SUMMARY
FILE_ROLES = {
    INFLUENCE_NAME: "proponents and opponents of each test example",
    SELF_JSONL_NAME: "training examples ranked by self-influence",
    SELF_CSV_NAME: "the same ranking as CSV",
    DATASET_JSONL_NAME: "training examples ranked by mean influence over the test examples",
    DATASET_CSV_NAME: "the same ranking as CSV",
    MATRIX_NAME: "full score matrix [test, scored training]",
    SUMMARY_NAME: "settings, timing and summary figures",
}
STRIDE = 1024  # records between two remembered offsets: a page read skips at most this many

T = TypeVar("T")


# --- rows -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Neighbour:
    """A training example as a proponent or opponent of one test example."""

    index: int
    score: float
    text: str
    label: int | None
    completion: str | None = None  # a causal LM's example: `text` is its prompt


@dataclass(frozen=True)
class InfluenceRecord:
    """One test example and the training examples that most raised (proponents) and lowered (opponents) its
    predicted label's probability, as TracIn scores them."""

    index: int
    text: str
    label: int | None
    proponents: tuple[Neighbour, ...]
    opponents: tuple[Neighbour, ...]
    prediction: int | None = None  # the class the model at the last checkpoint predicts; None in older runs
    probability: float | None = None  # of the prediction
    label_probability: float | None = None  # of the label
    completion: str | None = None  # a causal LM's example: `text` is its prompt
    completion_loss: float | None = None  # its loss at the last checkpoint (a causal LM's)


@dataclass(frozen=True)
class RankedExample:
    """A training example in the self-influence ranking."""

    rank: int
    index: int
    score: float
    text: str
    label: int | None
    flipped: bool | None  # the data's own mark of a deliberately flipped label; None when it has none
    completion: str | None = None  # a causal LM's example: `text` is its prompt


@dataclass(frozen=True)
class DatasetRanked:
    """A training example in the dataset-level ranking: its mean and max influence over the test examples (None
    where no test example was scored against it: a pair filter left them all out)."""

    rank: int
    index: int
    mean: float | None
    max: float | None
    n_queries: int
    text: str
    completion: str | None  # a causal LM's example
    label: int | None


def _completion(row: Mapping[str, Any], name: str) -> str | None:
    """A causal LM example's completion (None for a classifier's example)."""
    value = row.get("completion")
    return None if value is None else as_text(value, name)


def _neighbours(value: Any, name: str) -> tuple[Neighbour, ...]:
    if not isinstance(value, list):
        raise RecordError(f"{name}: expected a list, found {type(value).__name__}")
    out = []
    for i, item in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(item, dict):
            raise RecordError(f"{where}: expected an object")
        out.append(
            Neighbour(
                index=as_int(get_field(item, "index"), f"{where}.index"),
                score=as_float(get_field(item, "score"), f"{where}.score"),
                text=as_text(get_field(item, "text"), f"{where}.text"),
                label=as_label(item.get("label"), f"{where}.label"),
                completion=_completion(item, f"{where}.completion"),
            )
        )
    return tuple(out)


def parse_influence(row: Mapping[str, Any]) -> InfluenceRecord:
    return InfluenceRecord(
        index=as_int(get_field(row, "index"), "index"),
        text=as_text(get_field(row, "text"), "text"),
        label=as_label(row.get("label"), "label"),
        proponents=_neighbours(get_field(row, "proponents"), "proponents"),
        opponents=_neighbours(get_field(row, "opponents"), "opponents"),
        prediction=as_label(row.get("prediction"), "prediction"),
        probability=as_optional_float(row.get("probability"), "probability"),
        label_probability=as_optional_float(row.get("label_probability"), "label_probability"),
        completion=_completion(row, "completion"),
        completion_loss=as_optional_float(row.get("completion_loss"), "completion_loss"),
    )


def parse_ranked(row: Mapping[str, Any]) -> RankedExample:
    return RankedExample(
        rank=as_int(get_field(row, "rank"), "rank"),
        index=as_int(get_field(row, "index"), "index"),
        score=as_float(get_field(row, "self_influence"), "self_influence"),
        text=as_text(get_field(row, "text"), "text"),
        label=as_label(row.get("label"), "label"),
        flipped=as_flag(row.get("flipped"), "flipped"),
        completion=_completion(row, "completion"),
    )


def parse_dataset_ranked(row: Mapping[str, Any]) -> DatasetRanked:
    return DatasetRanked(
        rank=as_int(get_field(row, "rank"), "rank"),
        index=as_int(get_field(row, "index"), "index"),
        mean=as_optional_float(get_field(row, "mean_influence"), "mean_influence"),
        max=as_optional_float(get_field(row, "max_influence"), "max_influence"),
        n_queries=as_int(get_field(row, "n_queries"), "n_queries"),
        text=as_text(get_field(row, "text"), "text"),
        completion=_completion(row, "completion"),
        label=as_label(row.get("label"), "label"),
    )


# --- paged files ------------------------------------------------------------------------------------------------


def _records(f: IO[bytes], is_csv: bool) -> Iterator[tuple[int, bytes]]:
    """(start offset, raw record) from the file's current position. A JSONL record is a line; a CSV record
    runs on over line breaks inside quotes (a quote is escaped by doubling it, so an odd count means open)."""
    offset = f.tell()
    pending, start, quotes = b"", offset, 0
    for line in f:
        if not pending:
            start = offset
        offset += len(line)
        pending += line
        if is_csv:
            quotes += line.count(b'"')
            if quotes % 2:
                continue
            quotes = 0
        yield start, pending
        pending = b""
    if pending:
        yield start, pending


class PagedRecords(Generic[T]):
    """The records of a JSONL file (one JSON object a line) or a CSV file with a header, parsed by `parse`.

    The first use scans the file once; a file changed since (a run written again) is scanned again. Safe to
    use from several threads."""

    def __init__(
        self, path: Path, parse: Callable[[Mapping[str, Any]], T], *, is_csv: bool = False, stride: int = STRIDE
    ) -> None:
        self.path = Path(path)
        self.is_csv = is_csv
        self._parse = parse
        self._stride = stride
        self._lock = threading.Lock()
        self._signature: tuple[int, int] | None = None
        self._offsets: list[int] = []  # start of records 0, stride, 2 * stride, ...
        self._count = 0
        self._header: list[str] = []

    def __len__(self) -> int:
        with self._lock:
            self._index()
            return self._count

    def page(self, start: int, count: int) -> list[T]:
        """Records start .. start + count - 1 (fewer at the end of the file)."""
        with self._lock:
            self._index()
            if start < 0 or count <= 0 or start >= self._count:
                return []
            offset, skip = self._offsets[start // self._stride], start % self._stride
            header = self._header
        out: list[T] = []
        with self._open() as f:
            f.seek(offset)
            for position, (_, raw) in enumerate(_records(f, self.is_csv), start - skip):
                if position >= start:
                    out.append(self._decode(raw, position, header))
                    if len(out) == count:
                        break
        return out

    def _open(self) -> IO[bytes]:
        try:
            return self.path.open("rb")
        except OSError as e:
            raise UserError(f"{self.path}: cannot read ({e.strerror or e})") from None

    def _index(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise UserError(f"{self.path}: cannot read ({e.strerror or e})") from None
        signature = (st.st_size, st.st_mtime_ns)
        if signature == self._signature:
            return
        offsets: list[int] = []
        count = 0
        with self._open() as f:
            records = _records(f, self.is_csv)
            if self.is_csv:
                first = next(records, None)
                self._header = [] if first is None else self._split_csv(first[1], 1)
            for start, _ in records:
                if count % self._stride == 0:
                    offsets.append(start)
                count += 1
        self._offsets, self._count, self._signature = offsets, count, signature

    def _decode(self, raw: bytes, position: int, header: list[str]) -> T:
        where = f"{self.path}: row {position + 1}" if self.is_csv else f"{self.path}: line {position + 1}"
        try:
            if self.is_csv:
                fields = self._split_csv(raw, position + 2)
                if len(fields) != len(header):
                    raise RecordError(f"{len(fields)} fields where the header has {len(header)}")
                row: Any = dict(zip(header, fields))
            else:
                row = json.loads(raw)
                if not isinstance(row, dict):
                    raise RecordError("expected a JSON object")
            return self._parse(row)
        except (RecordError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{where}: {e}") from None

    def _split_csv(self, raw: bytes, line: int) -> list[str]:
        try:
            return next(csv.reader([raw.decode("utf-8").rstrip("\r\n")]), [])
        except (UnicodeDecodeError, csv.Error) as e:
            raise UserError(f"{self.path}: record at line {line}: {e}") from None


# --- a run's results --------------------------------------------------------------------------------------------


@dataclass
class TracInResults:
    """The result files a TracIn run has written so far; each part is None until its file exists."""

    results_dir: Path
    summary: TracInSummary | None
    influence: PagedRecords[InfluenceRecord] | None
    self_influence: PagedRecords[RankedExample] | None  # from the JSONL, else the CSV
    dataset_ranking: PagedRecords[DatasetRanked] | None = None  # likewise; None in runs made before it

    @property
    def empty(self) -> bool:
        parts = (self.summary, self.influence, self.self_influence, self.dataset_ranking)
        return all(part is None for part in parts)

    def files(self) -> list[tuple[Path, int]]:
        """The files in the results folder (path, size in bytes), the known ones first."""
        try:
            found = [p for p in self.results_dir.iterdir() if p.is_file() and not p.name.startswith(".")]
            sized = [(p, p.stat().st_size) for p in found]
        except OSError:
            return []
        known = list(FILE_ROLES)
        return sorted(sized, key=lambda f: (known.index(f[0].name) if f[0].name in known else len(known), f[0].name))


def load_results(folder: Path) -> TracInResults:
    """The results of a TracIn run from its results folder (`run_dir / "results"`). Reads summary.json at once
    (UserError when it is not a TracIn summary); the row files only when pages are asked for."""
    folder = Path(folder)
    summary_path = folder / SUMMARY_NAME
    influence = folder / INFLUENCE_NAME
    return TracInResults(
        results_dir=folder,
        summary=read_summary(summary_path) if summary_path.is_file() else None,
        influence=PagedRecords(influence, parse_influence) if influence.is_file() else None,
        self_influence=_rows(folder / SELF_JSONL_NAME, folder / SELF_CSV_NAME, parse_ranked),
        dataset_ranking=_rows(folder / DATASET_JSONL_NAME, folder / DATASET_CSV_NAME, parse_dataset_ranked),
    )


def _rows(jsonl: Path, csv_path: Path, parse: Callable[[Mapping[str, Any]], T]) -> PagedRecords[T] | None:
    """The records of the JSONL file, else of the CSV file with the same rows (None: neither exists)."""
    if jsonl.is_file():
        return PagedRecords(jsonl, parse)
    if csv_path.is_file():
        return PagedRecords(csv_path, parse, is_csv=True)
    return None
