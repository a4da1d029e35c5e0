"""The result files of an attribution run, read without torch (the TUI reads them through this module).

- attributions.jsonl: one line per sample. `SampleIndex.build` reads it once (in a worker: a 40k-sample file
  is a few hundred MB) and keeps, per line, its byte offset and the few fields a sample list shows; the
  tokens and scores of a sample are read again from its offset when the sample is opened. Unreadable lines
  are skipped and counted (a line damaged only inside its tokens or scores is noticed when it is opened).
- summary.json and check.json: read by attribution_summary.py.
- attributions.safetensors is listed (for export) but not read here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuopt_tui.core.attribution_summary import (
    CHECK_NAME,
    SUMMARY_NAME,
    AttributionSummary,
    CheckResult,
    load_check,
    load_summary,
    optional_bool,
    optional_float,
    optional_int,
)
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.io import load_profile
from gpuopt_tui.core.run_dir import RunDir

JSONL_NAME = "attributions.jsonl"
TENSORS_NAME = "attributions.safetensors"
EXPORTS = (
    (JSONL_NAME, "per-sample tokens and scores, one JSON line per sample"),
    (TENSORS_NAME, "padded score tensor, token ids, lengths, deltas (safetensors)"),
    (SUMMARY_NAME, "top tokens, convergence deltas, settings and timing"),
    (CHECK_NAME, "optimized vs original: relative difference and timings"),
)
CANCEL_CHECK_LINES = 512  # how often indexing looks at its cancel flag
TOKENS_KEY = b', "tokens": '  # the keys around the bulk of a line (tokens, scores), as the engine writes them
TARGET_KEY = b', "target": '


# --- per-sample lines -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TopToken:
    """One of a sample's top tokens by |score|; `position` is (token,) or, for two-tower samples,
    (candidate, token)."""

    position: tuple[int, ...]
    token: str
    score: float


@dataclass(frozen=True, slots=True)
class Segment:
    """One token sequence of a sample: the whole input, or one candidate of a two-tower sample."""

    text: str
    tokens: tuple[str, ...]
    scores: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class SampleEntry:
    """What a sample list shows of one line; kept for every sample while the line itself stays on disk."""

    offset: int  # byte offset of the line in the file
    index: int
    target: int
    label: int | None
    prediction: int
    probability: float
    delta: float
    relative_delta: float
    top_tokens: tuple[str, ...]
    search_text: str  # the sample's text, lower case (candidates joined by " | ")
    margin: float | None = None  # between the two largest outputs of the fp32 forward (None: not recorded)
    low_margin: bool = False  # that margin is within the error of the steps' precision
    steps: int | None = None  # interpolation steps the sample used (None: not recorded)
    full_precision: bool = False  # its steps ran in full precision (the full_precision_fallback setting)
    within_tolerance: bool | None = None  # "auto" steps: its relative delta and error estimate are within it
    error_estimate: float | None = None  # "auto" steps: the relative error estimate of its token scores

    @property
    def top_token(self) -> str:
        return self.top_tokens[0] if self.top_tokens else ""

    @property
    def wrong(self) -> bool:
        """The prediction differs from a known label."""
        return self.label is not None and self.prediction != self.label


@dataclass(frozen=True)
class Sample:
    """A whole line: its entry, its token sequences with their scores, and its top tokens."""

    entry: SampleEntry
    segments: tuple[Segment, ...]
    top: tuple[TopToken, ...]
    two_tower: bool

    @property
    def max_abs(self) -> float:
        return max((abs(s) for seg in self.segments for s in seg.scores), default=0.0)


def _record(line: bytes) -> dict[str, Any]:
    record = json.loads(line)
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    return record


def _entry(record: dict[str, Any], offset: int) -> SampleEntry:
    """The list fields of a record; its tokens and scores are not looked at (see parse_sample)."""
    text = record["text"]
    label = record.get("label")
    return SampleEntry(
        offset=offset,
        index=int(record["index"]),
        target=int(record["target"]),
        label=None if label is None else int(label),
        prediction=int(record["prediction"]),
        probability=float(record["probability"]),
        delta=float(record["delta"]),
        relative_delta=float(record["relative_delta"]),
        top_tokens=tuple(str(item[1]) for item in record.get("top") or ()),
        search_text=(" | ".join(map(str, text)) if isinstance(text, list) else str(text)).lower(),
        margin=optional_float(record.get("margin")),
        low_margin=bool(record.get("low_margin", False)),
        steps=optional_int(record.get("steps")),
        full_precision=bool(record.get("full_precision", False)),
        within_tolerance=optional_bool(record.get("within_tolerance")),
        error_estimate=optional_float(record.get("error_estimate")),
    )


def parse_sample(line: bytes, offset: int) -> Sample:
    """One line of attributions.jsonl; ValueError (or KeyError/TypeError) when it is not a sample record."""
    record = _record(line)
    texts, tokens, scores = record["text"], record["tokens"], record["scores"]
    two_tower = bool(tokens) and isinstance(tokens[0], list)
    if not two_tower:
        texts, tokens, scores = [texts], [tokens], [scores]
    if not (isinstance(texts, list) and len(texts) == len(tokens) == len(scores)):
        raise ValueError("text, tokens and scores do not have one entry per candidate")
    segments = []
    for text, toks, vals in zip(texts, tokens, scores):
        if not isinstance(toks, list) or not isinstance(vals, list) or len(toks) != len(vals):
            raise ValueError("tokens and scores differ in length")
        segments.append(Segment(str(text), tuple(str(t) for t in toks), tuple(float(v) for v in vals)))
    top = tuple(_top_token(item) for item in record.get("top") or ())
    return Sample(_entry(record, offset), tuple(segments), top, two_tower)


def _top_token(item: Any) -> TopToken:
    position, token, score = item
    where = tuple(int(p) for p in position) if isinstance(position, list) else (int(position),)
    return TopToken(where, str(token), float(score))


def _list_fields(line: bytes) -> dict[str, Any]:
    """The record of a line without parsing its tokens and scores (most of the line), when it has the engine's
    layout: keys in the engine's order, json.dumps' separators. A JSON string cannot hold an unescaped quote,
    so the first `, "tokens": ` and the next `, "target": ` are the keys themselves. Other lines are parsed
    whole."""
    start = line.find(TOKENS_KEY)
    end = line.find(TARGET_KEY, start + 1) if start >= 0 else -1
    if end < 0:
        record = _record(line)
        if not isinstance(record["tokens"], list) or not isinstance(record["scores"], list):
            raise ValueError("tokens and scores must be lists")
        return record
    return {**_record(line[:start] + b"}"), **_record(b"{" + line[end + 2 :])}


def _stamp(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


class SampleIndex:
    """The lines of an attributions.jsonl: entries in file order, the samples read on demand."""

    def __init__(self, path: Path, entries: Sequence[SampleEntry], corrupt: int, stamp: tuple[int, int, int]) -> None:
        self.path = path
        self.entries = tuple(entries)
        self.corrupt = corrupt  # unreadable lines that were skipped
        self._stamp = stamp

    @classmethod
    def build(cls, path: Path, cancelled: Callable[[], bool] = lambda: False) -> SampleIndex | None:
        """Read the file once, keeping each line's offset and list fields; None when `cancelled()` turned true.
        Raises UserError when the file cannot be read."""
        entries: list[SampleEntry] = []
        corrupt = 0
        try:
            with path.open("rb") as f:
                stamp = os.fstat(f.fileno())
                offset = 0
                for number, line in enumerate(f):
                    if number % CANCEL_CHECK_LINES == 0 and cancelled():
                        return None
                    if line.strip():
                        try:
                            entries.append(_entry(_list_fields(line), offset))
                        except (ValueError, KeyError, TypeError, IndexError):
                            corrupt += 1
                    offset += len(line)
        except OSError as e:
            raise UserError(f"{path}: cannot read it ({e.strerror or e})") from None
        return cls(path, entries, corrupt, (stamp.st_ino, stamp.st_size, stamp.st_mtime_ns))

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def current(self) -> bool:
        """Whether the file is still the one that was indexed (a resumed run may write it again)."""
        try:
            return _stamp(self.path) == self._stamp
        except OSError:
            return False

    def read(self, entry: SampleEntry) -> Sample:
        """The whole line of `entry`, read from its offset. UserError when the file changed or went away."""
        if not self.current:
            raise UserError(f"{self.path} changed since it was read; open the results again")
        try:
            with self.path.open("rb") as f:
                f.seek(entry.offset)
                line = f.readline()
            return parse_sample(line, entry.offset)
        except OSError as e:
            raise UserError(f"{self.path}: cannot read it ({e.strerror or e})") from None
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise UserError(f"{self.path}: the line at byte {entry.offset} is unreadable ({e})") from None


def page(rows: Sequence[SampleEntry], number: int, size: int) -> Sequence[SampleEntry]:
    """Rows of page `number` (from 0) of `size` rows each; empty past the end."""
    return rows[number * size : (number + 1) * size]


def page_count(rows: Sequence[SampleEntry], size: int) -> int:
    return max(1, -(-len(rows) // size))


# --- everything a run has -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportFile:
    name: str
    path: Path
    size: int
    description: str


@dataclass(frozen=True)
class RunFiles:
    """What an attribution run has written so far; each part is None until its file exists."""

    run_dir: Path
    summary: AttributionSummary | None = None
    check: CheckResult | None = None
    samples: SampleIndex | None = None
    exports: tuple[ExportFile, ...] = ()
    check_samples: int = 0  # attribution.check_samples of the run's frozen profile
    errors: tuple[str, ...] = ()  # files that exist but could not be read, and why

    @property
    def has_results(self) -> bool:
        return self.summary is not None or self.samples is not None


def export_files(run_dir: Path) -> tuple[ExportFile, ...]:
    found = []
    for name, description in EXPORTS:
        path = RunDir(run_dir).results / name
        try:
            found.append(ExportFile(name, path, path.stat().st_size, description))
        except OSError:
            continue
    return tuple(found)


def frozen_check_samples(run_dir: Path) -> int:
    """attribution.check_samples of the run's frozen profile (0 when it cannot be read)."""
    try:
        profile = load_profile(RunDir(run_dir).profile)
    except UserError:
        return 0
    section = getattr(profile, "attribution", None)
    return int(getattr(section, "check_samples", 0) or 0)


def load_run_files(run_dir: Path, cancelled: Callable[[], bool] = lambda: False) -> RunFiles | None:
    """Everything readable in the run's results (None when `cancelled()` turned true while indexing)."""
    results = RunDir(run_dir).results
    errors: list[str] = []
    parts: dict[str, Any] = {}
    for key, loader in (("summary", load_summary), ("check", load_check)):
        try:
            parts[key] = loader(results)
        except UserError as e:
            errors.append(str(e))
    jsonl = results / JSONL_NAME
    if jsonl.is_file():
        try:
            parts["samples"] = SampleIndex.build(jsonl, cancelled)
        except UserError as e:
            errors.append(str(e))
        if parts.get("samples") is None and cancelled():
            return None
    return RunFiles(
        run_dir=run_dir,
        exports=export_files(run_dir),
        check_samples=frozen_check_samples(run_dir),
        errors=tuple(errors),
        **parts,
    )
