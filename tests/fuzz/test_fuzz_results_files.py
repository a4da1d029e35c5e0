"""attributions.jsonl files of any size and shape (samples of up to 300,000 tokens, two-tower ones, damaged
bytes, wrong types): indexing the file, opening its first samples and laying out their heatmaps (what the results
view does before its first frame) end within a few seconds and a bounded memory per input, with a sample or a
UserError, never another exception. The index file written with a jsonl, damaged or left behind by a jsonl
damaged after it, gives what a full read of the jsonl gives, or is not used."""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.results.attribution import JSONL_NAME, SHOWN_TOKENS, SampleIndex, write_samples
from gpuopt_tui.core.results.attribution_index import index_path
from gpuopt_tui.ui.widgets.token_heatmap import heatmap

from .inputs import FUZZ, JSON_VALUES, damaged

FROZEN = Path(__file__).resolve().parents[1] / "fixtures" / "runs" / "attribution"
SECONDS = 5.0  # per input: well under a second here
MiB = 1024**2
OPENED = 3  # samples opened per file, as moving the cursor does
LENGTHS = st.sampled_from([0, 1, 7, SHOWN_TOKENS, SHOWN_TOKENS + 1, 20_000, 300_000])


def good_record() -> dict[str, Any]:
    (jsonl,) = FROZEN.glob(f"*/results/{JSONL_NAME}")
    return json.loads(jsonl.read_text(encoding="utf-8").splitlines()[0])


@st.composite
def records(draw: st.DrawFn) -> dict[str, Any]:
    """A sample record: flat or two-tower, of any length, a field perhaps replaced by any JSON value."""
    record = good_record()
    if draw(st.booleans()):
        record["tokens"] = [f"t{i % 50}" for i in range(draw(LENGTHS))]
        record["scores"] = [(i % 13 - 6) / 6 for i in range(len(record["tokens"]))]
    else:
        sizes = draw(st.lists(LENGTHS, min_size=1, max_size=3))
        record["text"] = [f"candidate {c}" for c in range(len(sizes))]
        record["tokens"] = [[f"t{i % 50}" for i in range(n)] for n in sizes]
        record["scores"] = [[0.25] * n for n in sizes]
    if draw(st.booleans()):
        key = draw(st.sampled_from(sorted(record)))
        record[key] = draw(JSON_VALUES)
    return record


@st.composite
def files(draw: st.DrawFn) -> bytes:
    lines = [json.dumps(r).encode() for r in draw(st.lists(records(), min_size=1, max_size=3))]
    data = b"\n".join(lines) + b"\n"
    if draw(st.booleans()):  # damage near the start, where the fields a list shows lie
        head = data[:4096]
        data = draw(damaged(head)) + data[4096:]
    return data


def open_like_the_view(path: Path) -> None:
    """Index the file, open its first samples and lay out their heatmaps 120 columns wide."""
    index = SampleIndex.build(path)
    assert index is not None
    for entry in index.entries[:OPENED]:
        try:
            sample = index.read(entry)
        except UserError:
            continue  # shown as the sample's heading: the line is unreadable
        assert sum(len(s.tokens) for s in sample.segments) <= SHOWN_TOKENS
        heatmap(sample).wrap(120)


@FUZZ
@given(data=files())
def test_any_results_file_opens_in_bounded_time_and_memory(scratch: Path, data: bytes) -> None:
    path = scratch / JSONL_NAME
    path.write_bytes(data)
    tracemalloc.start()
    start = time.monotonic()
    try:
        open_like_the_view(path)
    finally:
        elapsed = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert elapsed < SECONDS, f"{len(data)} bytes took {elapsed:.1f} s"
    assert peak < 3 * len(data) + 64 * MiB, f"{len(data)} bytes took {peak / MiB:.0f} MiB"


def shown(index: SampleIndex | None) -> tuple[list[str], int, int]:
    """What a sample list shows (repr: NaN equals NaN)."""
    assert index is not None
    return [repr(e) for e in index.entries], index.corrupt, index.too_long


@FUZZ
@given(rows=st.lists(records(), min_size=1, max_size=3), data=st.data())
def test_an_index_damaged_or_stale_never_shows_other_entries(
    scratch: Path, rows: list[dict[str, Any]], data: st.DataObject
) -> None:
    path = scratch / JSONL_NAME
    write_samples(path, rows)
    index = index_path(path)
    assert SampleIndex.build(path).index_file == index  # type: ignore[union-attr]
    if data.draw(st.booleans(), label="damage the index"):
        index.write_bytes(data.draw(damaged(index.read_bytes()), label="index"))
    else:  # the jsonl written again (its mtime moves on), damaged
        path.write_bytes(data.draw(damaged(path.read_bytes()), label="jsonl"))
    assert shown(SampleIndex.build(path)) == shown(SampleIndex.scan(path))
