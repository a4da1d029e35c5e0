"""Shared pieces of the fuzz suite: damaged versions of good files, and the CLI run in-process with the
checks every bad input must pass (a clear message, no traceback or internal error, an exit status that says
so, the user's file untouched)."""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from gpuopt_tui.cli import main

# fast enough for every test run; FUZZ_EXAMPLES=2000 for a long hunt
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# tokens that break readers: wrong types, non-finite and huge numbers, terminal escapes, markup, bad UTF-8
TOKENS = [
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"nan",
    b"inf",
    b"-1",
    b"0",
    b"1e400",
    b"99999999999999999999999",
    b"null",
    b"true",
    b"[]",
    b"{}",
    b'""',
    b'"x"',
    b"[5]",
    b'"\\u001b[2J"',
    b"\x1b[31m",
    b"\x07",
    b"\x00",
    b"\xff\xfe",
    b"\xef\xbb\xbf",
    b"[/]",
    b"[bold]",
    b"\n",
    b"\r\n",
    "\u2028".encode(),
    b'"',
    b"'",
    b",",
    b":",
    b"=",
    b"[",
    b"]",
    b"{",
    b"}",
    b"[[",
    b"]]",
    b'"""',
    b"\\",
    b"#",
]


@st.composite
def damaged(draw: st.DrawFn, good: bytes) -> bytes:
    """`good` with a few random edits: bytes replaced, deleted or inserted, tokens spliced in, lines
    duplicated or cut, the end cut off."""
    data = bytearray(good)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        edit = draw(st.sampled_from(["token", "bytes", "delete", "line", "truncate"]))
        if edit == "token":
            width = draw(st.integers(0, 8))
            data[at : at + width] = draw(st.sampled_from(TOKENS))
        elif edit == "bytes":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif edit == "delete":
            del data[at : at + draw(st.integers(1, 40))]
        elif edit == "line":
            lines = bytes(data).split(b"\n")
            i = draw(st.integers(0, len(lines) - 1))
            lines.insert(i, lines[i]) if draw(st.booleans()) else lines.pop(i)
            data = bytearray(b"\n".join(lines))
        else:
            del data[at:]
    return bytes(data)


# any JSON value, for a field that should hold something else
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@dataclass
class Result:
    code: int
    out: str
    err: str


def run_cli(*argv: str) -> Result:
    """`gpuopt-tui ARGV` in this process, its stdout and stderr captured."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return Result(code, out.getvalue(), err.getvalue())


def check_result(result: Result, path: Path) -> None:
    """What every run on damaged input must show: success, or a message naming the file at `path` with exit
    status 1; never a traceback, an internal error, or a raw terminal escape."""
    text = result.out + result.err
    assert "Traceback" not in text and "internal error" not in text, text
    assert "\x1b" not in text and "\x07" not in text and "\x9b" not in text, text
    assert result.code in (0, 1), result
    if result.code:
        assert path.name in text, text


def json_output(result: Result) -> Any:
    """--json output, which must be valid JSON (no bare NaN or Infinity) whatever the input."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in JSON output")

    return json.loads(result.out, parse_constant=refuse)


def unchanged(path: Path, action: Callable[[], None]) -> None:
    """Run `action` and check that the file at `path` is byte-identical afterwards."""
    before = path.read_bytes()
    action()
    assert path.read_bytes() == before, f"{path} was changed"
