"""Samples too long to show whole: an opened sample keeps its first SHOWN_TOKENS tokens and counts the others,
parsed in bounded time and memory however long its line; a line over MAX_LINE_BYTES is left out of the index,
counted; two-tower samples are cut across their candidates."""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from gpuopt_tui.core.results import attribution as attribution_results
from gpuopt_tui.core.results.attribution import JSONL_NAME, SHOWN_TOKENS, TOKEN_CHARS, SampleIndex, parse_sample

FROZEN = Path(__file__).resolve().parents[1] / "fixtures" / "runs" / "attribution"
MiB = 1024**2


def first_record() -> dict[str, Any]:
    (jsonl,) = FROZEN.glob(f"*/results/{JSONL_NAME}")
    return json.loads(jsonl.read_text(encoding="utf-8").splitlines()[0])


def long_line(tokens: int) -> bytes:
    record = first_record()
    record["tokens"] = [f"w{i % 97}" for i in range(tokens)]
    record["scores"] = [((i * 37) % 101 - 50) / 50 for i in range(tokens)]
    return json.dumps(record).encode() + b"\n"


def test_two_million_tokens_parse_in_bounded_time_and_memory(tmp_path: Path) -> None:
    """The whole sample took 109 s and 2.6 GB to show: only its first tokens are parsed now."""
    path = tmp_path / JSONL_NAME
    path.write_bytes(long_line(2_000_000))
    size = path.stat().st_size
    tracemalloc.start()
    start = time.monotonic()
    index = SampleIndex.build(path)
    assert index is not None and len(index) == 1
    sample = index.read(index.entries[0])
    elapsed = time.monotonic() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert elapsed < 10  # under a second here; generous for a loaded machine
    assert peak < 3 * size + 16 * MiB  # the line itself, not millions of parsed tokens
    assert len(sample.segments[0].tokens) == len(sample.segments[0].scores) == SHOWN_TOKENS
    assert sample.hidden == 2_000_000 - SHOWN_TOKENS
    assert sample.segments[0].tokens[:3] == ("w0", "w1", "w2")


def test_a_short_sample_is_whole_and_long_tokens_are_cut() -> None:
    record = first_record()
    sample = parse_sample(json.dumps(record).encode(), 0)
    assert sample.hidden == 0 and list(sample.segments[0].tokens) == record["tokens"]
    record["tokens"][1] = "x" * 10_000
    (cut,) = [t for t in parse_sample(json.dumps(record).encode(), 0).segments[0].tokens if t.startswith("x")]
    assert len(cut) == TOKEN_CHARS and cut.endswith("…")


def test_a_two_tower_sample_is_cut_across_its_candidates() -> None:
    record = first_record()
    sizes = [SHOWN_TOKENS - 10, 50, 7]
    record["text"] = [f"candidate {c}" for c in range(3)]
    record["tokens"] = [[f"t{c}.{i}" for i in range(n)] for c, n in enumerate(sizes)]
    record["scores"] = [[0.5] * n for n in sizes]
    sample = parse_sample(json.dumps(record).encode(), 0)
    assert sample.two_tower and [len(s.tokens) for s in sample.segments] == [SHOWN_TOKENS - 10, 10, 0]
    assert [s.text for s in sample.segments] == record["text"]
    assert sample.hidden == 40 + 7


@pytest.mark.parametrize("damage", ['"scores": [0.1, "x"', '"tokens": 5', '"scores": {"a": 1}'])
def test_a_damaged_array_is_unreadable_not_a_crash(damage: str) -> None:
    record = first_record()
    key = damage.split(":")[0]
    line = json.dumps(record).replace(f"{key}: [", damage + ", [", 1).encode()
    with pytest.raises((ValueError, KeyError, TypeError, IndexError)):
        parse_sample(line, 0)


def test_a_line_over_the_limit_is_left_out_and_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attribution_results, "MAX_LINE_BYTES", 64 * 1024)
    short = json.dumps(first_record()).encode() + b"\n"
    path = tmp_path / JSONL_NAME
    path.write_bytes(short + long_line(20_000) + short)
    index = SampleIndex.build(path)
    assert index is not None and (len(index), index.too_long, index.corrupt) == (2, 1, 0)
    second = index.entries[1]
    assert second.offset == path.stat().st_size - len(short)  # offsets past the long line stay right
    assert index.read(second).segments[0].tokens == index.read(index.entries[0]).segments[0].tokens
