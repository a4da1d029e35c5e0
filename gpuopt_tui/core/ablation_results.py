"""The results of a layer probing run (results/results.json and results.csv): written by the engine, read by the
TUI and the CLI without torch.

results.json holds the run's facts (samples, classes, chance accuracy, split sizes, device, cache hits) and one
row per (representation, probed layer): accuracy mean/std over the seeds on train/val/test, epochs, feature
and probe time. All-layers representations have a single row whose layer is "all" and layer_index null.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.io import atomic_write_text

FORMAT = 1
JSON_NAME = "results.json"
CSV_NAME = "results.csv"
ALL_LAYERS = "all"


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


COLUMNS = tuple(f.name for f in fields(ResultRow))
TABLE_HEADER = ("representation", "layer", "test acc", "val acc", "train acc", "dim", "time", "cached")


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
        """Rows for a table with TABLE_HEADER: accuracies as mean ± std, time in seconds."""
        out = []
        for r in self.rows:
            acc = [f"{m:.3f} ± {s:.3f}" for m, s in (r.accuracy(x) for x in ("test", "val", "train"))]
            seconds = r.feature_time_s + r.probe_time_s
            out.append(
                (r.representation, r.layer, *acc, str(r.feature_dim), f"{seconds:.2f}s", "yes" if r.cached else "")
            )
        return out

    def series(self, split: str = "test") -> dict[str, list[tuple[int, float, float]]]:
        """Per representation, (layer index, accuracy mean, std) over the probed layers, in layer order
        (all-layers probes have no layer and are left out)."""
        out: dict[str, list[tuple[int, float, float]]] = {}
        for r in self.rows:
            if r.layer_index is not None:
                out.setdefault(r.representation, []).append((r.layer_index, *r.accuracy(split)))
        return {name: sorted(points) for name, points in out.items()}

    def best(self, split: str = "test") -> dict[str, ResultRow]:
        """The row with the highest mean accuracy of each representation."""
        out: dict[str, ResultRow] = {}
        for r in self.rows:
            if r.representation not in out or r.accuracy(split)[0] > out[r.representation].accuracy(split)[0]:
                out[r.representation] = r
        return out


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
    for candidate in (path / "results" / JSON_NAME, path / JSON_NAME, path):
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
