"""The result files of an attribution run, read without torch (the TUI reads them through this module).

- attributions.jsonl: one line per sample, written with its index (`write_samples`, attribution_index.py): the
  offset, length and list fields of every line. `SampleIndex.build` reads that index when it is valid for the
  jsonl as it is; else (a run of an earlier version, an index damaged or stale) it reads the jsonl once (in a
  worker: a 40k-sample file is a few hundred MB) and keeps, per line, its byte offset and the few fields a sample
  list shows; the tokens and scores of a sample are read again from its offset when the sample is opened.
  Unreadable lines are skipped and counted (a line damaged only inside its tokens or scores is noticed when it is
  opened).
  Whatever the file holds, time and memory stay bounded: a line over MAX_LINE_BYTES is left out (counted), and
  an opened sample keeps only its first SHOWN_TOKENS tokens, parsed from the start of its arrays, with the
  count of the others.
  A causal LM run with per_target_token writes each completion token's row of the [completion, prompt] matrix
  last on its line (from `token_logprobs` on): the index leaves that tail alone, an opened sample reads it (its
  rows cut to the tokens kept) when it is at most WHOLE_LINE_BYTES, else says that it is too long to show.
- summary.json and check.json: read by attribution_summary.py.
- attributions.safetensors is listed (for export) but not read here.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, BinaryIO

from gpuopt_tui.core.atomic import write_jsonl
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.io import load_profile
from gpuopt_tui.core.results.attribution_index import index_path, read_index, write_index
from gpuopt_tui.core.results.attribution_summary import (
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
from gpuopt_tui.core.runs.layout import RunDir

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
SCORES_KEY = b', "scores": '
TARGET_KEY = b', "target": '
PER_TOKEN_KEY = b', "token_logprobs": '  # the first of a causal LM's per-token fields, written last
MAX_LINE_BYTES = 64 * 1024**2  # a longer line (some 2.5 million tokens) is left out of the index
SHOWN_TOKENS = 2_000  # tokens of a sample kept for its heatmap; the others are counted
TOKEN_CHARS = 80  # characters of a token kept (a longer one is cut, with "…")
SHOWN_TOP = 100  # top tokens of a sample kept
WHOLE_LINE_BYTES = 4 * 1024**2  # a line not in the engine's layout is parsed whole only up to this size
_WINDOW_BYTES = 1024**2  # bytes from the start of an array that its kept items are parsed from
# The read buffer of indexing. Each read of it lets go of the GIL, and while the app draws (as the results screen
# opens) the indexing thread may wait up to the interpreter's switch interval (5 ms) to get it back: a 150 MB file
# of causal LM lines (tens of KB each, with their [completion, prompt] matrices) read in the default 8 KB takes
# seconds beside a busy UI thread, in 1 MB 0.9 s, in 8 MB 0.26 s (0.09 s alone).
_INDEX_BUFFER_BYTES = 8 * 1024**2
_DECODER = json.JSONDecoder()
_BLANK = re.compile(r"[ \t\n\r]*")


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
    completion: str | None = None  # causal LMs: the completion whose log-probability the prompt tokens explain
    logprob: float | None = None  # causal LMs: that log-probability

    @property
    def top_token(self) -> str:
        return self.top_tokens[0] if self.top_tokens else ""

    @property
    def wrong(self) -> bool:
        """The prediction differs from a known label."""
        return self.label is not None and self.prediction != self.label


@dataclass(frozen=True, slots=True)
class CompletionToken:
    """One completion token of a causal LM sample and its row of the [completion, prompt] matrix: the prompt tokens'
    scores for its own log-probability (as many as the sample keeps), its top prompt tokens and its delta."""

    position: int  # in the completion, from 0
    token: str
    logprob: float
    delta: float
    relative_delta: float
    scores: tuple[float, ...]
    top: tuple[TopToken, ...]


@dataclass(frozen=True)
class Sample:
    """A whole line: its entry, its token sequences with their scores (the first SHOWN_TOKENS of them, and the
    count of the others), and its top tokens. A causal LM sample of a per_target_token run also has its completion
    tokens' rows (`completion_tokens`), or says why they are not shown (`rows_note`)."""

    entry: SampleEntry
    segments: tuple[Segment, ...]
    top: tuple[TopToken, ...]
    two_tower: bool
    hidden: int = 0  # tokens of the line not kept in `segments`
    completion_tokens: tuple[CompletionToken, ...] = ()
    rows_note: str = ""

    @property
    def max_abs(self) -> float:
        """The largest |score| of the tokens kept."""
        return max((abs(s) for seg in self.segments for s in seg.scores), default=0.0)

    def explaining(self, token: int | None) -> Sample:
        """The sample as completion token `token`'s row explains it: that row's scores, top tokens and delta (its
        steps are not recorded); None: the whole completion, the sample itself."""
        if token is None:
            return self
        row = self.completion_tokens[token]
        entry = replace(self.entry, delta=row.delta, relative_delta=row.relative_delta, steps=None)
        segment = replace(self.segments[0], scores=row.scores)
        return replace(self, entry=entry, segments=(segment,), top=row.top)


#: What reading a damaged line can raise (int() of a JSON Infinity: OverflowError).
UNREADABLE = (ValueError, KeyError, TypeError, IndexError, OverflowError)


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
        top_tokens=tuple(str(item[1]) for item in (record.get("top") or ())[:SHOWN_TOP]),
        search_text=(" | ".join(map(str, text)) if isinstance(text, list) else str(text)).lower(),
        margin=optional_float(record.get("margin")),
        low_margin=bool(record.get("low_margin", False)),
        steps=optional_int(record.get("steps")),
        full_precision=bool(record.get("full_precision", False)),
        within_tolerance=optional_bool(record.get("within_tolerance")),
        error_estimate=optional_float(record.get("error_estimate")),
        completion=None if record.get("completion") is None else str(record["completion"]),
        logprob=optional_float(record.get("logprob")),
    )


def line_entry(line: bytes, offset: int) -> SampleEntry:
    """The list fields of one line at byte `offset`; UNREADABLE when it is not a sample record."""
    return _entry(_list_fields(line), offset)


def parse_sample(line: bytes, offset: int) -> Sample:
    """One line of attributions.jsonl with its first SHOWN_TOKENS tokens; ValueError (or KeyError/TypeError) when
    it is not a sample record. In the engine's layout only the start of the tokens and scores is parsed (their
    count comes from the scores' commas), so a sample of millions of tokens costs little more than a short one."""
    record, tokens, scores, total = _bulk(line)
    texts = record["text"]
    two_tower = isinstance(tokens, list) and bool(tokens) and isinstance(tokens[0], list)
    if not two_tower:
        texts, tokens, scores = [texts], [tokens], [scores]
    whole = total is None
    if (
        not isinstance(texts, list)
        or len(tokens) > len(texts)
        or (whole and not len(texts) == len(scores) == len(tokens))
    ):
        raise ValueError("text, tokens and scores do not have one entry per candidate")
    segments = _segments(texts, tokens, scores, complete=whole)
    shown = sum(len(seg.tokens) for seg in segments)
    hidden = (total if total is not None else sum(len(t) for t in tokens)) - shown
    top = tuple(_top_token(item) for item in (record.get("top") or ())[:SHOWN_TOP])
    rows, note = _completion_rows(line, record, len(segments[0].tokens)) if not two_tower else ((), "")
    return Sample(_entry(record, offset), segments, top, two_tower, max(0, hidden), rows, note)


def _completion_rows(line: bytes, record: dict[str, Any], kept: int) -> tuple[tuple[CompletionToken, ...], str]:
    """A causal LM sample's per-token rows, each cut to the `kept` prompt tokens shown (none for other samples), or
    why they are not read."""
    if "token_logprobs" in record:  # a line parsed whole
        fields = record
    else:
        at = line.find(PER_TOKEN_KEY)
        if at < 0:
            return (), ""
        if len(line) - at > WHOLE_LINE_BYTES:
            limit = WHOLE_LINE_BYTES // 1024**2
            return (), f"its completion tokens' rows take over {limit} MiB of the line: see {JSONL_NAME}"
        fields = _record(b"{" + line[at + 2 :])
    tokens = record.get("completion_tokens") or ()
    keys = ("token_logprobs", "token_deltas", "token_relative_deltas", "token_top", "matrix")
    if missing := [key for key in keys if key not in fields]:
        return (), f"its completion tokens' rows lack {', '.join(missing)} (an earlier version's run): see {JSONL_NAME}"
    columns = tuple(fields[key] for key in keys)
    if any(not isinstance(c, list) or len(c) != len(tokens) for c in columns):
        raise ValueError("the per-token fields do not have one entry per completion token")
    return tuple(
        CompletionToken(
            position=t,
            token=_token(token),
            logprob=float(logprob),
            delta=float(delta),
            relative_delta=float(relative),
            scores=tuple(float(v) for v in row[:kept]),
            top=tuple(_top_token(item) for item in top[:SHOWN_TOP]),
        )
        for t, (token, logprob, delta, relative, top, row) in enumerate(zip(tokens, *columns))
    ), ""


def _bulk(line: bytes) -> tuple[dict[str, Any], Any, Any, int | None]:
    """A line's record, its tokens and scores (their first SHOWN_TOKENS in the engine's layout), and how many
    scores it holds (None: the arrays are whole)."""
    spans = _bulk_spans(line)
    if spans is None:
        if len(line) > WHOLE_LINE_BYTES:
            raise ValueError(f"not in the engine's layout, and over {WHOLE_LINE_BYTES // 1024**2} MiB to parse whole")
        record = _record(line)
        return record, record["tokens"], record["scores"], None
    tokens_at, scores_at, end = spans
    return (
        _list_fields(line),
        _array_start(line, tokens_at),
        _array_start(line, scores_at),
        _leaves(line, scores_at, end),
    )


def _segments(texts: list[Any], tokens: list[Any], scores: list[Any], complete: bool) -> tuple[Segment, ...]:
    """One segment per candidate with the sample's first SHOWN_TOKENS tokens. Arrays parsed whole (`complete`)
    must pair every token with a score; arrays parsed from their start may stop at different places."""
    segments = []
    room = SHOWN_TOKENS
    for i, text in enumerate(texts):
        toks = tokens[i] if i < len(tokens) else []
        vals = scores[i] if i < len(scores) else []
        if not isinstance(toks, list) or not isinstance(vals, list) or (complete and len(toks) != len(vals)):
            raise ValueError("tokens and scores differ in length")
        n = min(len(toks), len(vals), room)
        room -= n
        segments.append(Segment(str(text), tuple(_token(t) for t in toks[:n]), tuple(float(v) for v in vals[:n])))
    return tuple(segments)


def _token(token: Any) -> str:
    text = str(token)
    return text if len(text) <= TOKEN_CHARS else text[: TOKEN_CHARS - 1] + "…"


def _bulk_spans(line: bytes) -> tuple[int, int, int] | None:
    """Where the tokens array starts, where the scores array starts and where it ends (at the next key) in a line
    of the engine's layout (see _list_fields); None for another layout."""
    start = line.find(TOKENS_KEY)
    scores = line.find(SCORES_KEY, start + 1) if start >= 0 else -1
    end = line.find(TARGET_KEY, scores + 1) if scores >= 0 else -1
    if end < 0:
        return None
    return start + len(TOKENS_KEY), scores + len(SCORES_KEY), end


def _array_start(line: bytes, at: int) -> list[Any]:
    """The JSON array at byte `at` of `line` as far as its first SHOWN_TOKENS leaves (an array of arrays keeps its
    nesting), parsed from at most _WINDOW_BYTES."""
    window = line[at : at + _WINDOW_BYTES].decode("utf-8", errors="replace")
    if not window.startswith("["):
        raise ValueError("tokens and scores must be lists")
    return _items(window, 0, [SHOWN_TOKENS], cut=len(line) - at > _WINDOW_BYTES)[0]


def _items(text: str, at: int, room: list[int], cut: bool) -> tuple[list[Any], int]:
    """The items of the array at `text[at]` while `room[0]` (leaves left) lasts, and where parsing stopped. Bad
    JSON raises ValueError, unless it is a value cut off by the end of a `cut` window: then the array ends there."""
    items: list[Any] = []
    at = _skip_blank(text, at + 1)
    while at < len(text) and text[at] != "]":
        try:
            if text[at] == "[":
                inner, at = _items(text, at, room, cut)
                items.append(inner)
            else:
                value, at = _DECODER.raw_decode(text, at)
                if cut and at == len(text):  # a number the window's end may have cut short
                    return items, at
                items.append(value)
                room[0] -= 1
        except ValueError:
            if cut:  # the rest of the window is not parsed
                return items, len(text)
            raise
        if room[0] == 0:  # the leaves wanted are parsed: the rest is left alone
            return items, at
        at = _skip_blank(text, at)
        if text.startswith(",", at):
            at = _skip_blank(text, at + 1)
        elif at < len(text) and text[at] != "]":
            raise ValueError("expected , or ] in an array")
    return items, at + 1


def _skip_blank(text: str, at: int) -> int:
    return _BLANK.match(text, at).end()  # type: ignore[union-attr]


def _leaves(line: bytes, start: int, end: int) -> int:
    """How many numbers the scores array `line[start:end]` holds (flat, or one array per candidate), counted from
    its commas and brackets without parsing it (numbers hold neither)."""
    lists = max(1, line.count(b"[", start, end) - 1)
    return line.count(b",", start, end) - (lists - 1) + lists - line.count(b"[]", start, end)


def _top_token(item: Any) -> TopToken:
    position, token, score = item
    where = tuple(int(p) for p in position) if isinstance(position, list) else (int(position),)
    return TopToken(where, str(token), float(score))


def _list_fields(line: bytes) -> dict[str, Any]:
    """The record of a line without parsing its tokens and scores (most of the line) nor a causal LM's per-token
    fields (the rest of it), when it has the engine's layout: keys in the engine's order, json.dumps' separators.
    A JSON string cannot hold an unescaped quote, so the first `, "tokens": ` and the next `, "target": ` and
    `, "token_logprobs": ` are the keys themselves. Other lines are parsed whole."""
    start = line.find(TOKENS_KEY)
    end = line.find(TARGET_KEY, start + 1) if start >= 0 else -1
    if end < 0:
        record = _record(line)
        if not isinstance(record["tokens"], list) or not isinstance(record["scores"], list):
            raise ValueError("tokens and scores must be lists")
        return record
    tail = line.find(PER_TOKEN_KEY, end + 1)
    rest = line[end + 2 :] if tail < 0 else line[end + 2 : tail] + b"}"
    return {**_record(line[:start] + b"}"), **_record(b"{" + rest)}


def _lines(f: BinaryIO) -> Iterator[tuple[bytes, int]]:
    """Each line of `f` with its length; a line over MAX_LINE_BYTES comes cut (its length says so), the rest of it
    read in pieces and dropped, so that no line is ever held whole."""
    while line := f.readline(MAX_LINE_BYTES + 1):
        length = len(line)
        while length > MAX_LINE_BYTES and not line.endswith(b"\n"):
            line = f.readline(MAX_LINE_BYTES)
            if not line:
                break
            length += len(line)
        yield line if length <= MAX_LINE_BYTES else b"", length


# --- the index file: one row per line, [offset, length, *ENTRY_FIELDS] ---------------------------------------

ENTRY_FIELDS = tuple(f.name for f in fields(SampleEntry) if f.name != "offset")  # in the order of SampleEntry
# the JSON types each field's value may have in a row (top_tokens: a list of strings)
_OPTIONAL_INT, _OPTIONAL_FLOAT = (int, type(None)), (float, type(None))
_ROW_TYPES: dict[str, tuple[type, ...]] = {
    "index": (int,),
    "target": (int,),
    "label": _OPTIONAL_INT,
    "prediction": (int,),
    "probability": (float,),
    "delta": (float,),
    "relative_delta": (float,),
    "top_tokens": (list,),
    "search_text": (str,),
    "margin": _OPTIONAL_FLOAT,
    "low_margin": (bool,),
    "steps": _OPTIONAL_INT,
    "full_precision": (bool,),
    "within_tolerance": (bool, type(None)),
    "error_estimate": _OPTIONAL_FLOAT,
    "completion": (str, type(None)),
    "logprob": _OPTIONAL_FLOAT,
}
_ROW_KINDS = tuple(_ROW_TYPES[name] for name in ENTRY_FIELDS)
_TOP_TOKENS = ENTRY_FIELDS.index("top_tokens")


def _entry_row(entry: SampleEntry, length: int) -> list[Any]:
    values = (getattr(entry, name) for name in ENTRY_FIELDS)
    return [entry.offset, length, *(list(v) if isinstance(v, tuple) else v for v in values)]


def _row_entries(rows: list[list[Any]]) -> list[SampleEntry]:
    """The entries of index rows (read_index checked their offsets and lengths); TypeError for a value of another
    type than the writer's. Checked a column at a time (a 1B-model run's index has 2048 rows of 17 values: 6 ms,
    against 9 ms value by value)."""
    for column, kinds in enumerate(_ROW_KINDS, start=2):
        if not {type(row[column]) for row in rows} <= set(kinds):
            raise TypeError(f"{ENTRY_FIELDS[column - 2]}: a value of another type than the index's writer's")
    top = _TOP_TOKENS + 2
    if not {type(token) for row in rows for token in row[top]} <= {str}:
        raise TypeError("top_tokens: not a list of strings")
    entries = []
    for row in rows:
        values = row[2:]
        values[_TOP_TOKENS] = tuple(values[_TOP_TOKENS])
        entries.append(SampleEntry(row[0], *values))
    return entries


class _IndexRows:
    """The index rows of lines as they are written, counted as a full read counts them."""

    def __init__(self) -> None:
        self.rows: list[list[Any]] = []
        self.corrupt = self.too_long = self.offset = 0

    def __call__(self, line: bytes) -> None:
        if len(line) > MAX_LINE_BYTES:
            self.too_long += 1
        elif not line.isspace():
            try:
                self.rows.append(_entry_row(line_entry(line, self.offset), len(line)))
            except UNREADABLE:
                self.corrupt += 1
        self.offset += len(line)


def write_samples(path: Path, records: Iterable[dict[str, Any]]) -> str | None:
    """Write attributions.jsonl atomically, one line per record, then its index (an index of an earlier file is
    removed first: a failure in between leaves the jsonl without one, read whole). The index only speeds up opening
    the run: when it cannot be written, a note that says so is returned (None when it was written)."""
    index_path(path).unlink(missing_ok=True)
    rows = _IndexRows()
    write_jsonl(path, records, rows)
    try:
        write_index(path, ENTRY_FIELDS, rows.rows, rows.corrupt, rows.too_long)
    except (OSError, UserError) as e:
        return f"{index_path(path).name} was not written ({e}): opening the run reads {path.name} whole"
    return None


def _stamp(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


class SampleIndex:
    """The lines of an attributions.jsonl: entries in file order, the samples read on demand."""

    def __init__(
        self,
        path: Path,
        entries: Sequence[SampleEntry],
        corrupt: int,
        stamp: tuple[int, int, int],
        too_long: int = 0,
        index_file: Path | None = None,
    ) -> None:
        self.path = path
        self.entries = tuple(entries)
        self.corrupt = corrupt  # unreadable lines that were skipped
        self.too_long = too_long  # lines over MAX_LINE_BYTES that were left out
        self.index_file = index_file  # the index file the entries were read from (None: from the jsonl itself)
        self._stamp = stamp

    @classmethod
    def build(cls, path: Path, cancelled: Callable[[], bool] = lambda: False) -> SampleIndex | None:
        """The entries of the file's index file when it is valid for the file as it is, else of the file read once
        (`scan`); None when `cancelled()` turned true. Raises UserError when the file cannot be read."""
        indexed = cls.from_index_file(path)
        if indexed is None:
            return cls.scan(path, cancelled)
        return None if cancelled() else indexed

    @classmethod
    def from_index_file(cls, path: Path) -> SampleIndex | None:
        """The entries of the index file of `path`; None when it is missing, damaged or stale."""
        loaded = read_index(path, ENTRY_FIELDS)
        if loaded is None:
            return None
        try:
            entries = _row_entries(loaded.rows)
        except (TypeError, ValueError):
            return None
        st = loaded.stat
        return cls(path, entries, loaded.corrupt, (st.st_ino, st.st_size, st.st_mtime_ns), loaded.too_long, loaded.path)

    @classmethod
    def scan(cls, path: Path, cancelled: Callable[[], bool] = lambda: False) -> SampleIndex | None:
        """Read the file once, keeping each line's offset and list fields; None when `cancelled()` turned true.
        Raises UserError when the file cannot be read."""
        entries: list[SampleEntry] = []
        corrupt = too_long = 0
        try:
            with path.open("rb", buffering=_INDEX_BUFFER_BYTES) as f:
                stamp = os.fstat(f.fileno())
                offset = 0
                for number, (line, length) in enumerate(_lines(f)):
                    if number % CANCEL_CHECK_LINES == 0 and cancelled():
                        return None
                    if length > MAX_LINE_BYTES:
                        too_long += 1
                    elif line and not line.isspace():  # (strip() would copy the line)
                        try:
                            entries.append(line_entry(line, offset))
                        except UNREADABLE:
                            corrupt += 1
                    offset += length
        except OSError as e:
            raise UserError(f"{path}: cannot read it ({e.strerror or e})") from None
        return cls(path, entries, corrupt, (stamp.st_ino, stamp.st_size, stamp.st_mtime_ns), too_long)

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
                line = f.readline(MAX_LINE_BYTES + 1)  # an indexed line is no longer
            sample = parse_sample(line, entry.offset)
        except OSError as e:
            raise UserError(f"{self.path}: cannot read it ({e.strerror or e})") from None
        except UNREADABLE as e:
            raise UserError(f"{self.path}: the line at byte {entry.offset} is unreadable ({e})") from None
        if sample.entry.index != entry.index:  # (an index file checked against the jsonl never leads here)
            raise UserError(f"{self.path}: the line at byte {entry.offset} is not sample {entry.index}")
        return sample


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
