"""Datasets for the engines: tokenized tensors plus the raw texts, read from jsonl/csv or the demo.

A `TextDataset` keeps every tensor padded to the dataset's longest example; `batches` hands out batches in
any order (e.g. `length_sorted_order`) and, by default, trims each batch to its own longest real length so
that no compute is spent on all-padding columns.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.format import safe_text
from gpuopt_tui.core.json_line import JsonLineError, parse_json_line
from gpuopt_tui.core.profiles.common import DataSection
from gpuopt_tui.jobs.context import StageFn, no_stage

if TYPE_CHECKING:
    from gpuopt_tui.jobs.models.base import Adapter, Batch

#: A parsed record and where it came from ("file:line"), for error messages.
Row = tuple[str, dict[str, Any]]

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}


@dataclass
class TextDataset:
    """N examples: `tensors` (each with first dim N, "labels" among them when known), the raw `texts`
    (a string per example; for the two-tower model, the example's candidate titles), the adapter's
    `token_fields` (for trimming) and `meta` (e.g. the demo train split's "flipped" label indices)."""

    tensors: dict[str, Tensor]
    texts: list[Any]
    token_fields: dict[str, str]
    origin: str
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        if len(set(sizes.values())) > 1 or (sizes and len(self.texts) != next(iter(sizes.values()))):
            raise ValueError(f"tensors and texts differ in length: {sizes}, texts {len(self.texts)}")

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def labels(self) -> Tensor | None:
        return self.tensors.get("labels")

    def lengths(self) -> Tensor:
        """Real tokens per example [N] (for several sequences per example, the longest of them)."""
        return _longest(self.tensors["attention_mask"])

    def tokens(self) -> Tensor:
        """Real tokens per example [N] over all its token fields, each counted as `lengths` counts it: the length
        of what the model runs (a causal LM's prompt and completion are one sequence). What batches are sorted
        and sized by; `lengths` is the attributed field's alone."""
        masks = [self.tensors[m] for m in dict.fromkeys(self.token_fields.values()) if m in self.tensors]
        return torch.stack([_longest(m) for m in masks]).sum(0) if masks else self.lengths()

    def batch(self, indices: Sequence[int] | Tensor) -> Batch:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return {k: v[idx] for k, v in self.tensors.items()}

    def subset(self, indices: Sequence[int]) -> TextDataset:
        """The examples at `indices`, in that order (meta is kept as is)."""
        idx = [int(i) for i in indices]
        return replace(self, tensors=self.batch(idx), texts=[self.texts[i] for i in idx])

    def head(self, n: int) -> TextDataset:
        """The first `n` examples (all of them when n is 0 or exceeds the size)."""
        return self if n <= 0 or n >= len(self) else self.subset(range(n))


def _longest(mask: Tensor) -> Tensor:
    """[N]: real positions of each example's mask, the longest of its sequences when it has several."""
    return mask.sum(-1).reshape(mask.shape[0], -1).amax(-1)


# --- batching ------------------------------------------------------------------------------------------------
def length_sorted_order(ds: TextDataset, *, descending: bool = True) -> list[int]:
    """Example indices sorted by real length (`TextDataset.tokens`, stable), so that batches hold examples of
    similar length.
    Longest first by default: the first batch then shows at once whether memory suffices."""
    lengths = ds.tokens()
    order = torch.sort(-lengths if descending else lengths, stable=True).indices
    return order.tolist()


def trim_batch(batch: Mapping[str, Tensor], token_fields: Mapping[str, str]) -> Batch:
    """Cut the positions at either end that are padding in every row of the batch (trailing ones for right
    padding, leading ones for left padding).

    Each key in `token_fields` is cut along its last dimension to the span of its mask's real positions.
    """
    out = dict(batch)
    span_by_mask: dict[str, slice] = {}
    for key, mask_key in token_fields.items():
        if key not in batch or mask_key not in batch:
            continue
        if mask_key not in span_by_mask:
            mask = batch[mask_key]
            real = mask.reshape(-1, mask.shape[-1]).bool().any(0).nonzero().flatten().tolist()
            span_by_mask[mask_key] = slice(real[0], real[-1] + 1) if real else slice(0, 1 if mask.numel() else None)
        span = span_by_mask[mask_key]
        out[key] = batch[key][..., span]
        out[mask_key] = batch[mask_key][..., span]
    return out


def batches(
    ds: TextDataset, batch_size: int, order: Sequence[int] | None = None, *, trim: bool = True
) -> Iterator[tuple[list[int], Batch]]:
    """(example indices, batch) pairs of at most `batch_size` examples in `order` (default: dataset order);
    batches are trimmed to their longest real length unless `trim` is False. Tensors stay on the CPU."""
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    order = list(range(len(ds))) if order is None else [int(i) for i in order]
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = ds.batch(idx)
        yield idx, trim_batch(batch, ds.token_fields) if trim else batch


# --- loading -------------------------------------------------------------------------------------------------
def load_dataset(
    data: DataSection,
    adapter: Adapter,
    *,
    split: str | None = None,
    path: str | Path | None = None,
    stage: StageFn = no_stage,
) -> TextDataset:
    """The dataset a profile's [data] section describes, tokenized for `adapter`.

    `split` overrides data.split for the demo source; `path` reads another file with the same fields (its
    format from the extension: .jsonl/.json/.ndjson or .csv), e.g. TracIn's training file. `stage` hears
    what is done: reading the file, then tokenizing its texts.
    """
    if path is not None:
        file = Path(path).expanduser()
        fmt = FORMATS.get(file.suffix.lower()) or (data.source if data.source != "demo" else "")
        if not fmt:
            raise UserError(f"{file}: cannot tell the format from the extension (expected .jsonl or .csv)")
    elif data.source == "demo":
        stage(f"loading the demo's {split or data.split} data")
        return adapter.builtin_dataset(split or data.split, data)
    else:
        file, fmt = Path(data.path).expanduser(), data.source
    stage(f"reading {file.name}")
    rows = read_jsonl(file) if fmt == "jsonl" else read_csv(file)
    if not rows:
        raise UserError(f"{file}: no examples in the file")
    stage(f"tokenizing {len(rows):,} examples of {file.name}")
    return adapter.dataset_from_rows(rows, data)


def cut_texts_note(ds: TextDataset, data: DataSection, adapter: Adapter) -> str | None:
    """A line for the run log when texts reach the token limit (longer ones were cut there, so their tail is
    not seen); None when none does."""
    limit = min(data.max_length, adapter.max_positions)
    at_limit = int((ds.lengths() >= limit).sum())
    if not at_limit:
        return None
    if data.max_length <= adapter.max_positions:
        why = "data.max_length; the model takes up to " + str(adapter.max_positions)
    else:
        why = f"the model's position table; data.max_length = {data.max_length}"
    return f"{at_limit} of {len(ds)} texts ({ds.origin}) reach the {limit}-token limit ({why}): longer ones were cut"


def read_jsonl(path: Path) -> list[Row]:
    # lines end at "\n" only: a JSON string may hold other line separators (U+2028, form feed)
    lines = _read_text(path).split("\n")
    rows: list[Row] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = parse_json_line(line)
        except JsonLineError as exc:
            raise UserError(f"{where}: not valid JSON ({exc})") from None
        if not isinstance(record, dict):
            raise UserError(f"{where}: expected a JSON object per line, got {type(record).__name__}")
        rows.append((where, record))
    return rows


def read_csv(path: Path) -> list[Row]:
    # newline="": a quoted field may span lines; line numbers count the header as line 1
    reader = csv.DictReader(io.StringIO(_read_text(path), newline=""))
    rows: list[Row] = []
    try:
        if not reader.fieldnames:
            raise UserError(f"{path}: empty CSV file (expected a header line)")
        for record in reader:
            rows.append((f"{path}:{reader.line_num}", dict(record)))
    except csv.Error as exc:
        raise UserError(f"{path}:{reader.line_num}: not valid CSV ({exc})") from None
    return rows


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise UserError(f"{path}: data file not found")
    try:
        return path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read the data file ({exc})") from exc


def field_value(row: Row, key: str) -> Any:
    """The value of `key` in a row; UserError naming the file, line and key when it is missing."""
    where, record = row
    if key not in record or record[key] is None:
        have = ", ".join(shown_text(k) for k in record if k is not None) or "none"
        raise UserError(f'{where}: missing key "{key}" (have: {shown_text(have, 200)})')
    return record[key]


def shown_text(value: Any, limit: int = 60) -> str:
    """Text from a data file, for a message: control characters as '?', cut to `limit` characters."""
    text = safe_text(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def read_labels(rows: Sequence[Row], key: str, num_labels: int) -> Tensor | None:
    """Integer labels in [0, num_labels) from `key`; None when no row has the key."""
    present = [row for row in rows if row[1].get(key) not in (None, "")]
    if not present:
        return None
    if len(present) != len(rows):
        missing = next(row for row in rows if row[1].get(key) in (None, ""))
        raise UserError(f'{missing[0]}: missing label "{key}" (other rows have one; give all or none)')
    labels = []
    for where, record in rows:
        value = record[key]
        if isinstance(value, str) and re.fullmatch(r"\s*-?[0-9]{1,18}\s*", value):
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            got = shown_text(repr(record[key]))
            raise UserError(f'{where}: label "{key}" must be an integer class index, got {got}')
        if not 0 <= value < num_labels:
            raise UserError(f'{where}: label "{key}" = {shown_text(value)} is outside 0..{num_labels - 1}')
        labels.append(value)
    return torch.tensor(labels, dtype=torch.long)


def text_dataset_from_rows(adapter: Adapter, rows: Sequence[Row], data: DataSection) -> TextDataset:
    """One text per row from data.text_field, labels from data.label_field when present."""
    texts = []
    for row in rows:
        value = field_value(row, data.text_field)
        if not isinstance(value, str):
            raise UserError(f'{row[0]}: "{data.text_field}" must be a string, got {type(value).__name__}')
        texts.append(value)
    tensors = adapter.tokenize(texts, data.max_length)
    labels = read_labels(rows, data.label_field, adapter.num_labels)
    if labels is not None:
        tensors["labels"] = labels
    origin = rows[0][0].rsplit(":", 1)[0]
    return TextDataset(tensors, texts, dict(adapter.token_fields), origin)
