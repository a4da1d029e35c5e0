"""The results of a layer probing run (results/results.json and results.csv): written by the engine, read by the
TUI and the CLI without torch.

results.json holds the run's facts (samples, classes, chance accuracy, split sizes, device, cache hits) and one
row per (representation, probed layer): accuracy mean/std over the seeds on train/val/test, epochs, feature
and probe time. All-layers representations have a single row whose layer is "all" and layer_index null.

While a run goes on, its finished probes are known only from its events (`ReportedProbes` folds them): test
accuracy mean/std per (representation, layer). Tables, series and bests work on either kind of row.
"""

from __future__ import annotations

import csv
import io
import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol, TypeVar

from gpuopt_tui.core.atomic import atomic_write_text
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.runs.layout import RunDir

FORMAT = 1
JSON_NAME = "results.json"
CSV_NAME = "results.csv"
ALL_LAYERS = "all"
SPLITS = ("test", "val", "train")
PROBE_METRIC = "probe_test_acc"
FEATURE_METRIC = "feature_seconds"


@dataclass(frozen=True)
class ResultRow:
    representation: str
    layer: str
    layer_index: int | None  # position among the source's layers; None for an all-layers probe
    feature_dim: int
    train_acc_mean: float
    train_acc_std: float
    val_acc_mean: float
    val_acc_std: float
    test_acc_mean: float
    test_acc_std: float
    epochs_mean: float  # epochs trained before early stopping
    feature_time_s: float  # computing this probe's features (loading them, when cached)
    probe_time_s: float  # share of the batched probe training that trained this probe's seeds
    cached: bool  # features came from the feature cache

    def accuracy(self, split: str = "test") -> tuple[float, float]:
        return getattr(self, f"{split}_acc_mean"), getattr(self, f"{split}_acc_std")


@dataclass(frozen=True)
class ReportedProbe:
    """A probe that a running run has finished, as its "probe_test_acc" metric event tells: the test and
    validation accuracy (the training accuracy, the feature width and the times come with results.json at the
    end; events of older runs have no validation accuracy)."""

    representation: str
    layer: str
    layer_index: int | None
    test_acc_mean: float
    test_acc_std: float
    val_acc: tuple[float, float] | None = None

    def accuracy(self, split: str = "test") -> tuple[float, float] | None:
        if split == "test":
            return self.test_acc_mean, self.test_acc_std
        return self.val_acc if split == "val" else None


class ProbeRow(Protocol):
    """What tables, series and bests need of a row: a ResultRow or a ReportedProbe."""

    @property
    def representation(self) -> str: ...
    @property
    def layer(self) -> str: ...
    @property
    def layer_index(self) -> int | None: ...
    def accuracy(self, split: str = "test") -> tuple[float, float] | None: ...


Row = TypeVar("Row", bound=ProbeRow)
COLUMNS = tuple(f.name for f in fields(ResultRow))
TABLE_HEADER = ("representation", "layer", "test acc", "val acc", "train acc", "dim", "features", "probes", "cached")


def table_cells(rows: Sequence[ResultRow | ReportedProbe]) -> list[tuple[str, ...]]:
    """The rows' cells under TABLE_HEADER, in the order given: accuracies as mean ± std, the time of the row's
    features, and the time of the probes trained together in one batch (they share `probe_time_s`) once, on the
    first of them, with how many they are; "" where not known yet."""
    group_sizes = Counter(r.probe_time_s for r in rows if isinstance(r, ResultRow))
    seen: set[float] = set()
    cells = []
    for row in rows:
        accuracies = [_mean_std(row.accuracy(split)) for split in SPLITS]
        if isinstance(row, ReportedProbe):
            cells.append((row.representation, row.layer, *accuracies, "", "", "", ""))
            continue
        group = row.probe_time_s
        size = group_sizes[group]
        probes = "" if group in seen else f"{group:.2f}s" + (f" ×{size}" if size > 1 else "")
        seen.add(group)
        cells.append(
            (
                row.representation,
                row.layer,
                *accuracies,
                str(row.feature_dim),
                f"{row.feature_time_s:.2f}s",
                probes,
                "yes" if row.cached else "",
            )
        )
    return cells


def _mean_std(value: tuple[float, float] | None) -> str:
    return "" if value is None else f"{value[0]:.3f} ± {value[1]:.3f}"


def series_of(rows: Iterable[ProbeRow], split: str = "test") -> dict[str, list[tuple[int, float, float]]]:
    """Per representation, (layer index, accuracy mean, std) over the probed layers, in layer order. All-layers
    probes (no layer) and rows without this split's accuracy are left out."""
    out: dict[str, list[tuple[int, float, float]]] = {}
    for r in rows:
        value = r.accuracy(split)
        if r.layer_index is not None and value is not None:
            out.setdefault(r.representation, []).append((r.layer_index, *value))
    return {name: sorted(points) for name, points in out.items()}


SELECTION_SPLIT = "val"  # the layer of each representation is chosen on validation, never on test


def best_of(rows: Iterable[Row]) -> dict[str, Row]:
    """The selected row of each representation: the highest mean *validation* accuracy (the first one on a
    tie), so that its test accuracy, reported once for it, is an unbiased estimate. Rows without a validation
    accuracy (a running run of an older version) are never selected."""
    out: dict[str, Row] = {}
    for r in rows:
        value = r.accuracy(SELECTION_SPLIT)
        if value is None:
            continue
        held = out.get(r.representation)
        if held is None or value[0] > _mean(held):
            out[r.representation] = r
    return out


def _mean(row: ProbeRow) -> float:
    value = row.accuracy(SELECTION_SPLIT)
    return value[0] if value is not None else float("-inf")


def sort_rows(rows: Iterable[Row], column: str | None = None, descending: bool = False) -> list[Row]:
    """Rows in table order: by representation (in order of first appearance), then layer; or by a TABLE_HEADER
    column, ties in table order. Rows without a value in that column (a running run's val accuracy) go last."""
    rows = list(rows)
    rank = {name: i for i, name in enumerate(dict.fromkeys(r.representation for r in rows))}

    def layer_rank(r: ProbeRow) -> float:
        return float("inf") if r.layer_index is None else r.layer_index

    natural = sorted(rows, key=lambda r: (rank[r.representation], layer_rank(r)))
    if column is None or column == "representation":
        return natural[::-1] if descending else natural
    if column == "layer":
        ordered = sorted(natural, key=lambda r: (layer_rank(r), rank[r.representation]))
        return ordered[::-1] if descending else ordered
    if column not in TABLE_HEADER:
        raise ValueError(column)
    known = [(value, r) for r in natural if (value := _sort_value(r, column)) is not None]
    known.sort(key=lambda pair: pair[0], reverse=descending)  # stable: ties keep table order
    missing = [r for r in natural if _sort_value(r, column) is None]
    return [r for _, r in known] + missing


def _sort_value(row: ProbeRow, column: str) -> float | None:
    if column.endswith(" acc"):
        value = row.accuracy(column.removesuffix(" acc"))
        return None if value is None else value[0]
    if not isinstance(row, ResultRow):
        return None
    if column == "dim":
        return float(row.feature_dim)
    if column == "features":
        return row.feature_time_s
    if column == "probes":
        return row.probe_time_s
    return float(row.cached)


class ReportedProbes:
    """What a probing run has reported so far, folded from its events: finished probes (metric
    "probe_test_acc"), features computed or loaded (metric "feature_seconds") and the number of probes
    (progress events counted in probes). Events of other kinds, and malformed ones, are ignored."""

    def __init__(self) -> None:
        self._probes: dict[tuple[str, str], ReportedProbe] = {}
        self._features: dict[tuple[str, str], tuple[float, bool]] = {}  # (representation, layer) -> (s, cached)
        self.total: int | None = None

    @property
    def rows(self) -> list[ReportedProbe]:
        return list(self._probes.values())

    @property
    def features(self) -> int:
        return len(self._features)

    @property
    def features_cached(self) -> int:
        return sum(cached for _, cached in self._features.values())

    @property
    def feature_seconds(self) -> float:
        return sum(seconds for seconds, _ in self._features.values())

    def add(self, events: Iterable[Mapping[str, Any]]) -> bool:
        """Fold new events in; True when anything shown changed."""
        changed = False
        for event in events:
            if event.get("type") == "progress" and event.get("unit") == "probes":
                total = event.get("total")
                if isinstance(total, int) and total != self.total:
                    self.total, changed = total, True
            elif event.get("type") == "metric":
                changed = self._metric(event) or changed
        return changed

    def _metric(self, event: Mapping[str, Any]) -> bool:
        name, value = event.get("name"), event.get("value")
        representation, layer = event.get("representation"), event.get("layer")
        if not (isinstance(representation, str) and isinstance(layer, str) and _is_number(value)):
            return False
        if name == PROBE_METRIC:
            index, std = event.get("layer_index"), event.get("std", 0.0)
            if not (index is None or isinstance(index, int)) or not _is_number(std):
                return False
            val, val_std = event.get("val"), event.get("val_std", 0.0)
            val_acc = (float(val), float(val_std)) if _is_number(val) and _is_number(val_std) else None
            self._probes[representation, layer] = ReportedProbe(
                representation, layer, index, float(value), float(std), val_acc
            )
            return True
        if name == FEATURE_METRIC:
            self._features[representation, layer] = (float(value), bool(event.get("cached")))
            return True
        return False


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class AblationResults:
    path: Path
    info: dict[str, Any]  # samples, classes, chance_acc, split, device, precision, cache, source, ...
    rows: tuple[ResultRow, ...]

    @property
    def representations(self) -> list[str]:
        return list(dict.fromkeys(r.representation for r in self.rows))

    @property
    def chance(self) -> float | None:
        value = self.info.get("chance_acc")
        return float(value) if isinstance(value, (int, float)) else None

    def table(self) -> list[tuple[str, ...]]:
        """Rows for a table with TABLE_HEADER (see table_cells)."""
        return table_cells(self.rows)

    def series(self, split: str = "test") -> dict[str, list[tuple[int, float, float]]]:
        """Per representation, (layer index, accuracy mean, std) over the probed layers, in layer order
        (all-layers probes have no layer and are left out)."""
        return series_of(self.rows, split)

    def best(self) -> dict[str, ResultRow]:
        """The selected row of each representation (see `best_of`: on validation accuracy)."""
        return best_of(self.rows)


def write_results(results_dir: Path, info: Mapping[str, Any], rows: Sequence[ResultRow]) -> tuple[Path, Path]:
    """Write results.json and results.csv atomically; returns their paths."""
    payload = {"format": FORMAT, **info, "rows": [{c: getattr(r, c) for c in COLUMNS} for r in rows]}
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(COLUMNS)
    for r in rows:
        writer.writerow(["" if getattr(r, c) is None else getattr(r, c) for c in COLUMNS])
    json_path, csv_path = results_dir / JSON_NAME, results_dir / CSV_NAME
    atomic_write_text(json_path, json.dumps(payload, indent=1))
    atomic_write_text(csv_path, text.getvalue())
    return json_path, csv_path


def load_results(path: Path) -> AblationResults:
    """Read results.json from a run folder, its results folder, or the file itself."""
    path = Path(path)
    for candidate in (RunDir(path).results / JSON_NAME, path / JSON_NAME, path):
        if candidate.is_file():
            path = candidate
            break
    else:
        raise UserError(f"{path}: no {JSON_NAME} (has the probing run finished?)")
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not a readable results file ({exc})") from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or not isinstance(payload.get("rows"), list):
        raise UserError(f"{path}: not a layer probing results file of format {FORMAT}")
    rows = []
    for i, raw in enumerate(payload["rows"]):
        try:
            rows.append(ResultRow(**{c: raw[c] for c in COLUMNS}))
        except (KeyError, TypeError) as exc:
            raise UserError(f"{path}: rows[{i}] is incomplete ({exc})") from exc
    info = {k: v for k, v in payload.items() if k not in ("format", "rows")}
    return AblationResults(path, info, tuple(rows))
