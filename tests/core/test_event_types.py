"""EVENT_TYPES is the list of what runs write to events.jsonl: every type the source writes is in it, every type
in it is written, and every type a reader looks for is one of them."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from gpuopt_tui.core.runs.events import EVENT_TYPES, RANK_END_TYPES

SOURCE = Path(__file__).resolve().parents[2] / "gpuopt_tui"
WRITERS = frozenset({"emit", "event", "_emit", "on_event"})  # EventWriter, JobContext, engines' hooks


def trees() -> Iterator[tuple[Path, ast.AST]]:
    for path in sorted(SOURCE.rglob("*.py")):
        yield path, ast.parse(path.read_text(encoding="utf-8"), str(path))


def outcomes(tree: ast.AST) -> Iterator[str]:
    """The types of the runner's outcomes (functions returning an `Outcome`: ("finished", fields), ...), which
    it writes as the run's last event."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and isinstance(node.returns, ast.Name) and node.returns.id == "Outcome":
            for ret in ast.walk(node):
                if isinstance(ret, ast.Return) and isinstance(ret.value, ast.Tuple):
                    first = ret.value.elts[0]
                    if isinstance(first, ast.Constant) and isinstance(first.value, str):
                        yield first.value


def written_types(tree: ast.AST) -> Iterator[str]:
    yield from outcomes(tree)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in WRITERS:
            continue
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            yield first.value
        elif isinstance(first, ast.JoinedStr):  # f"rank_{outcome}": a worker's end
            prefix = first.values[0]
            assert isinstance(prefix, ast.Constant) and prefix.value == "rank_", ast.unparse(first)
            yield from RANK_END_TYPES


def _is_type_of_event(node: ast.AST) -> bool:
    """`event["type"]`, `event.get("type")` or a variable named `etype`."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "type"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "type"
    return isinstance(node, ast.Name) and node.id == "etype"


def _handler_table_keys(node: ast.AST) -> list[ast.expr | None]:
    """The keys of a table of event handlers (`EVENT_HANDLERS: ... = {"started": ..., ...}`)."""
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(node.value, ast.Dict):
        return node.value.keys if node.target.id.endswith("EVENT_HANDLERS") else []
    return []


def read_types(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        yield from (
            k.value for k in _handler_table_keys(node) if isinstance(k, ast.Constant) and isinstance(k.value, str)
        )
        if isinstance(node, ast.Compare) and _is_type_of_event(node.left):
            for right in node.comparators:
                values = right.elts if isinstance(right, (ast.Tuple, ast.List, ast.Set)) else [right]
                yield from (v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str))


def test_every_type_written_is_listed_and_every_listed_type_is_written() -> None:
    written: dict[str, list[str]] = {}
    for path, tree in trees():
        for etype in written_types(tree):
            written.setdefault(etype, []).append(path.relative_to(SOURCE).as_posix())
    unlisted = {t: where for t, where in written.items() if t not in EVENT_TYPES}
    assert not unlisted, f"written but not in core.runs.events.EVENT_TYPES: {unlisted}"
    assert EVENT_TYPES - set(written) == set(), "listed in EVENT_TYPES but never written"


def test_readers_look_only_for_listed_types() -> None:
    for path, tree in trees():
        unknown = set(read_types(tree)) - EVENT_TYPES
        assert not unknown, f"{path.relative_to(SOURCE)} looks for events of unknown types {sorted(unknown)}"


def test_the_finder_sees_the_writers_and_readers() -> None:
    """The checks above are only as good as what they find: the source's writers and readers are found."""
    runner = ast.parse((SOURCE / "jobs" / "runner.py").read_text(encoding="utf-8"))
    assert {"started", "failed", "finished", "cancelled"} <= set(written_types(runner))
    assert {"rank_failed", "rank_finished", "rank_cancelled"} <= set(read_types(runner))
    follow = ast.parse((SOURCE / "commands" / "follow.py").read_text(encoding="utf-8"))
    assert {"started", "progress", "log", "warning", "rank_failed"} <= set(read_types(follow))
