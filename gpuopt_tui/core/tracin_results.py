"""The result files of a TracIn run (written by jobs/tracin/job.py), read without torch by the TUI.

- influence.jsonl: one line per test example: index, text, label, the model's prediction at the last checkpoint
  with its probability and the label's (absent from older runs), and its `proponents` and `opponents`
  (training index, score, text, label), strongest first.
- self_influence.jsonl, and the same rows in self_influence.csv: every scored training example ranked by
  self-influence, highest first; `flipped` only where the data marks deliberately flipped labels (the demo).
- summary.json: checkpoints with their learning rates, the parameters that counted, the gradient method,
  timing, the label names and the checkpoint the predictions come from (both absent from older runs), and the
  flipped-label AUC where the data marks flipped labels.

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

INFLUENCE_NAME = "influence.jsonl"
SELF_JSONL_NAME = "self_influence.jsonl"
SELF_CSV_NAME = "self_influence.csv"
MATRIX_NAME = "scores.safetensors"
SUMMARY_NAME = "summary.json"
FILE_ROLES = {
    INFLUENCE_NAME: "proponents and opponents of each test example",
    SELF_JSONL_NAME: "training examples ranked by self-influence",
    SELF_CSV_NAME: "the same ranking as CSV",
    MATRIX_NAME: "full score matrix [test, scored training]",
    SUMMARY_NAME: "settings, timing and summary figures",
}
STRIDE = 1024  # records between two remembered offsets: a page read skips at most this many

T = TypeVar("T")


class RecordError(ValueError):
    """A record that does not have the expected fields (the reader adds the file and the line)."""


# --- rows -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Neighbour:
    """A training example as a proponent or opponent of one test example."""

    index: int
    score: float
    text: str
    label: int | None


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


@dataclass(frozen=True)
class RankedExample:
    """A training example in the self-influence ranking."""

    rank: int
    index: int
    score: float
    text: str
    label: int | None
    flipped: bool | None  # the data's own mark of a deliberately flipped label; None when it has none


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise RecordError(f"{name}: expected an integer, found {value!r}")
    try:
        return int(value)
    except ValueError:
        raise RecordError(f"{name}: expected an integer, found {value!r}") from None


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise RecordError(f"{name}: expected a number, found {value!r}")
    try:
        return float(value)
    except ValueError:
        raise RecordError(f"{name}: expected a number, found {value!r}") from None


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise RecordError(f"{name}: expected a text, found {value!r}")
    return value


def _label(value: Any, name: str) -> int | None:
    return None if value is None or value == "" else _int(value, name)


def _flag(value: Any, name: str) -> bool | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        return value
    if value in ("True", "False"):  # how the CSV writes them
        return value == "True"
    raise RecordError(f"{name}: expected true or false, found {value!r}")


def _get(row: Mapping[str, Any], key: str) -> Any:
    if key not in row:
        raise RecordError(f"no {key!r}")
    return row[key]


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
                index=_int(_get(item, "index"), f"{where}.index"),
                score=_float(_get(item, "score"), f"{where}.score"),
                text=_text(_get(item, "text"), f"{where}.text"),
                label=_label(item.get("label"), f"{where}.label"),
            )
        )
    return tuple(out)


def parse_influence(row: Mapping[str, Any]) -> InfluenceRecord:
    return InfluenceRecord(
        index=_int(_get(row, "index"), "index"),
        text=_text(_get(row, "text"), "text"),
        label=_label(row.get("label"), "label"),
        proponents=_neighbours(_get(row, "proponents"), "proponents"),
        opponents=_neighbours(_get(row, "opponents"), "opponents"),
        prediction=_label(row.get("prediction"), "prediction"),
        probability=_optional_float(row.get("probability"), "probability"),
        label_probability=_optional_float(row.get("label_probability"), "label_probability"),
    )


def parse_ranked(row: Mapping[str, Any]) -> RankedExample:
    return RankedExample(
        rank=_int(_get(row, "rank"), "rank"),
        index=_int(_get(row, "index"), "index"),
        score=_float(_get(row, "self_influence"), "self_influence"),
        text=_text(_get(row, "text"), "text"),
        label=_label(row.get("label"), "label"),
        flipped=_flag(row.get("flipped"), "flipped"),
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


# --- summary ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    lr: float


METHOD_NAMES = {"closed_form": "closed form", "vmap": "vmap"}


@dataclass(frozen=True)
class TracInSummary:
    """What summary.json says about a run (the figures the screen shows)."""

    model: str
    n_train: int
    n_test: int
    n_scored: int  # training examples scored (fewer than n_train only with a filter)
    checkpoints: tuple[CheckpointInfo, ...]
    method: str  # closed_form or vmap
    projection_dim: int  # 0: exact gradients
    precision: str
    layers: str  # which parameters counted, as set in the profile
    filter: str
    n_parameters: int
    parameter_tensors: tuple[str, ...]
    gradient_size: int  # numbers per example gradient (after projection)
    compute_seconds: float | None
    train_examples_per_s: float | None
    oom_retries: int
    flipped_label_auc: float | None  # only where the data marks flipped labels
    label_names: tuple[str, ...] | None = None  # by class index; None when the model has none (or older runs)
    predictions_checkpoint: str = ""  # where the test predictions come from; "" in older runs

    def label_name(self, label: int | None) -> str:
        """A class as its name where the model names it, else its number ("-" for none)."""
        if label is None:
            return "-"
        names = self.label_names
        return names[label] if names and 0 <= label < len(names) else str(label)

    @property
    def mode(self) -> str:
        method = METHOD_NAMES.get(self.method, self.method)
        if self.projection_dim:
            return f"{method}, random projection to ≤{self.projection_dim} numbers per tensor"
        return f"{method}, exact gradients"


def _layers_text(settings: Mapping[str, Any]) -> str:
    layers = settings.get("layers")
    if layers == "last":
        return f"last {settings.get('n_last_layers')} modules"
    if layers == "names":
        return "named: " + ", ".join(str(n) for n in settings.get("layer_names") or [])
    return str(layers)


def _optional_float(value: Any, name: str) -> float | None:
    return None if value is None else _float(value, name)


def parse_summary(data: Mapping[str, Any]) -> TracInSummary:
    settings = _get(data, "settings")
    timing = data.get("timing") or {}
    if not isinstance(settings, dict) or not isinstance(timing, dict):
        raise RecordError("settings and timing: expected objects")
    checkpoints = _get(data, "checkpoints")
    tensors = _get(data, "parameter_tensors")
    if not isinstance(checkpoints, list) or not isinstance(tensors, list):
        raise RecordError("checkpoints and parameter_tensors: expected lists")
    ckpts = []
    for i, c in enumerate(checkpoints):
        if not isinstance(c, dict):
            raise RecordError(f"checkpoints[{i}]: expected an object")
        path, lr = _text(_get(c, "path"), f"checkpoints[{i}].path"), _float(_get(c, "lr"), f"checkpoints[{i}].lr")
        ckpts.append(CheckpointInfo(path, lr))
    return TracInSummary(
        model=_text(_get(data, "model"), "model"),
        n_train=_int(_get(data, "n_train"), "n_train"),
        n_test=_int(_get(data, "n_test"), "n_test"),
        n_scored=_int(_get(data, "n_scored"), "n_scored"),
        checkpoints=tuple(ckpts),
        method=_text(_get(data, "method"), "method"),
        projection_dim=_int(settings.get("projection_dim", 0), "settings.projection_dim"),
        precision=_text(_get(data, "precision"), "precision"),
        layers=_layers_text(settings),
        filter=str(settings.get("filter", "none")),
        n_parameters=_int(_get(data, "n_parameters"), "n_parameters"),
        parameter_tensors=tuple(_text(t, "parameter_tensors") for t in tensors),
        gradient_size=_int(_get(data, "gradient_size"), "gradient_size"),
        compute_seconds=_optional_float(timing.get("compute_seconds"), "timing.compute_seconds"),
        train_examples_per_s=_optional_float(timing.get("train_examples_per_s"), "timing.train_examples_per_s"),
        oom_retries=_int(data.get("oom_retries", 0), "oom_retries"),
        flipped_label_auc=_optional_float(data.get("flipped_label_auc"), "flipped_label_auc"),
        label_names=_label_names(data.get("label_names")),
        predictions_checkpoint=_text(data.get("predictions_checkpoint") or "", "predictions_checkpoint"),
    )


def _label_names(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise RecordError(f"label_names: expected a list, found {type(value).__name__}")
    return tuple(_text(name, f"label_names[{i}]") for i, name in enumerate(value))


def read_summary(path: Path) -> TracInSummary:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not a readable summary ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    try:
        return parse_summary(data)
    except RecordError as e:
        raise UserError(f"{path}: {e}") from None


# --- a run's results --------------------------------------------------------------------------------------------


@dataclass
class TracInResults:
    """The result files a TracIn run has written so far; each part is None until its file exists."""

    results_dir: Path
    summary: TracInSummary | None
    influence: PagedRecords[InfluenceRecord] | None
    self_influence: PagedRecords[RankedExample] | None  # from the JSONL, else the CSV

    @property
    def empty(self) -> bool:
        return self.summary is None and self.influence is None and self.self_influence is None

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
    self_jsonl, self_csv = folder / SELF_JSONL_NAME, folder / SELF_CSV_NAME
    ranked: PagedRecords[RankedExample] | None = None
    if self_jsonl.is_file():
        ranked = PagedRecords(self_jsonl, parse_ranked)
    elif self_csv.is_file():
        ranked = PagedRecords(self_csv, parse_ranked, is_csv=True)
    influence = folder / INFLUENCE_NAME
    return TracInResults(
        results_dir=folder,
        summary=read_summary(summary_path) if summary_path.is_file() else None,
        influence=PagedRecords(influence, parse_influence) if influence.is_file() else None,
        self_influence=ranked,
    )
