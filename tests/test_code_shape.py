"""No function in gpuopt_tui/ is over MAX_LINES lines long or above MAX_COMPLEXITY in cyclomatic complexity.

How it is measured, from the source's syntax tree (the `ast` module, no other tool):
- length: the lines from a function's `def` to its last line (`end_lineno - lineno + 1`), its docstring,
  comments, blank lines and nested functions included (decorators are not);
- cyclomatic complexity: 1, plus 1 for each `if`/`elif`, `for`, `async for`, `while`, `except` clause,
  conditional expression (`a if c else b`), `if` of a comprehension and `case` of a `match`, plus n - 1 for each
  `and`/`or` chain of n operands. A function nested in another (or a class body in it) is measured on its own
  and adds nothing to the function around it; a lambda counts as part of the function it is written in.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gpuopt_tui"
MAX_LINES = 120
MAX_COMPLEXITY = 30
BRANCHES = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.ExceptHandler, ast.IfExp, ast.match_case)
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
Function = ast.FunctionDef | ast.AsyncFunctionDef


def complexity(function: Function) -> int:
    """Cyclomatic complexity of `function`, as the module docstring says."""
    count = 1
    todo: list[ast.AST] = list(ast.iter_child_nodes(function))
    while todo:
        node = todo.pop()
        if isinstance(node, SCOPES):
            continue
        if isinstance(node, BRANCHES):
            count += 1
        elif isinstance(node, ast.comprehension):
            count += len(node.ifs)
        elif isinstance(node, ast.BoolOp):
            count += len(node.values) - 1
        todo.extend(ast.iter_child_nodes(node))
    return count


def length(function: Function) -> int:
    assert function.end_lineno is not None
    return function.end_lineno - function.lineno + 1


def functions(source: str) -> Iterator[Function]:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def measured() -> Iterator[tuple[str, int, int]]:
    """(where, lines, complexity) of every function of the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for function in functions(path.read_text(encoding="utf-8")):
            where = f"{path.relative_to(PACKAGE.parent)}:{function.lineno} {function.name}"
            yield where, length(function), complexity(function)


def test_no_function_is_too_long_or_too_branched() -> None:
    rows = list(measured())
    assert len(rows) > 1000  # the walk found the package's functions
    long = [f"{where}: {lines} lines" for where, lines, _ in rows if lines > MAX_LINES]
    branched = [f"{where}: complexity {cc}" for where, _, cc in rows if cc > MAX_COMPLEXITY]
    assert not long, f"over {MAX_LINES} lines: {long}"
    assert not branched, f"above cyclomatic complexity {MAX_COMPLEXITY}: {branched}"


SAMPLE = '''
def flat(x):
    """A docstring."""
    return x


def branchy(xs, flag):
    def inner(z):
        return z if z else None

    for x in xs:
        if x and flag or not x:
            continue
        elif x > 2:
            pass
    while flag:
        try:
            flag = False
        except ValueError:
            pass
        except KeyError:
            pass
    y = [a for a in xs if a if a > 1]
    match flag:
        case 1:
            pass
        case _:
            pass
    return 1 if y else 0
'''


@pytest.mark.parametrize(
    ("name", "lines", "cc"),
    [
        # for, if, elif, and/or (3 operands: +2), while, 2 excepts, 2 comprehension ifs, 2 cases, if-expression
        ("branchy", 23, 1 + 1 + 1 + 1 + 2 + 1 + 2 + 2 + 2 + 1),
        ("flat", 3, 1),
        ("inner", 2, 2),
    ],
)
def test_the_measure_counts_what_the_docstring_says(name: str, lines: int, cc: int) -> None:
    function = next(f for f in functions(SAMPLE) if f.name == name)
    assert (length(function), complexity(function)) == (lines, cc)
