"""Where a monitor's terminal bytes go: the bytes written to each screen row, from the raw pty output.

Follows the cursor through absolute and relative moves (CUP, CUU/CUD/CUF/CUB, CHA, VPA, CR, LF, BS) and counts
each byte, escape sequences included, against the row the cursor is on; text also lands on a small screen
model, so that each row can be shown with what it holds at the end. Characters are taken as one cell wide.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"\x1b\[([0-9;?]*)([@-~])|\x1b[()][0-9A-Za-z]|\x1b[^\[]|[\x00-\x1f]")


@dataclass
class RowBytes:
    row: int  # 0-based screen row
    total: int  # every byte sent while the cursor was on this row
    styles: int  # of which SGR (colour and attribute) sequences
    text: str  # what the row holds at the end


def _args(params: str, count: int, default: int) -> list[int]:
    values = [int(p) if p.isdigit() else default for p in params.split(";")] if params else []
    return values + [default] * (count - len(values))


def row_bytes(before: bytes, window: bytes, columns: int, rows: int) -> list[RowBytes]:
    """Bytes per screen row of `window`, output of a program in a `columns` x `rows` terminal that had already
    written `before` (drawn on the screen model, not counted)."""
    screen = [[" "] * columns for _ in range(rows)]
    total, styles = [0] * rows, [0] * rows
    row = col = 0
    for counted, stream in ((False, before), (True, window)):
        text = stream.decode("utf-8", "replace")
        position = 0
        for match in [*_TOKEN.finditer(text), None]:
            plain = text[position : len(text) if match is None else match.start()]
            if counted and 0 <= row < rows:
                total[row] += len(plain.encode())
            for char in plain:
                if 0 <= row < rows and 0 <= col < columns:
                    screen[row][col] = char
                col += 1
            if match is None:
                break
            position = match.end()
            token, params, final = match.group(0), match.group(1) or "", match.group(2) or ""
            if counted and 0 <= row < rows:
                total[row] += len(token.encode())
                styles[row] += len(token.encode()) if final == "m" else 0
            if final in ("H", "f"):
                y, x = _args(params, 2, 1)
                row, col = y - 1, x - 1
            elif final and final in "ABCD":
                (step,) = _args(params, 1, 1)
                row += {"A": -step, "B": step}.get(final, 0)
                col += {"C": step, "D": -step}.get(final, 0)
            elif final == "G":
                col = _args(params, 1, 1)[0] - 1
            elif final == "d":
                row = _args(params, 1, 1)[0] - 1
            elif token == "\r":
                col = 0
            elif token == "\n":
                row += 1
            elif token == "\b":
                col = max(0, col - 1)
    return [RowBytes(y, total[y], styles[y], "".join(screen[y]).rstrip()) for y in range(rows)]
