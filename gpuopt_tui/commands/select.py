"""`gpuopt-tui select ID [--top K | --percent P] [--by mean|max] [--out FILE]`: the training examples of a TracIn
run that most raised the run's test (query) examples' likelihood, from its dataset-level ranking: printed, or
exported as JSONL or CSV for training on the subset."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpuopt_tui.core.atomic import write_csv, write_jsonl
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.results.tracin import DATASET_JSONL_NAME, DatasetRanked, load_results
from gpuopt_tui.core.results.tracin_selection import RANK_BY, select_top, selection_records, selection_size
from gpuopt_tui.core.runs.layout import RunDir
from gpuopt_tui.core.runs.lifecycle import find_run

NAME = "select"
HELP = "select the training examples of a TracIn run that helped its test set most (the top k or top percent)"
DEFAULT_TOP = 20
TEXT_WIDTH = 60


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_id", metavar="ID", help="id (or unique prefix) of a finished TracIn run")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--top", type=int, metavar="K", help=f"the K highest-ranked examples (default {DEFAULT_TOP})")
    size.add_argument("--percent", type=float, metavar="P", help="the top P%% of the scored examples (rounded up)")
    parser.add_argument(
        "--by", choices=RANK_BY, default="mean", help="rank by mean or max influence over the test set (default mean)"
    )
    parser.add_argument("--out", type=Path, metavar="FILE", help="write the selection to FILE (.jsonl or .csv)")


def run(args: argparse.Namespace) -> int:
    run_dir = find_run(args.run_id)
    ranking = load_results(RunDir(run_dir).results).dataset_ranking
    if ranking is None:
        raise UserError(
            f"run {run_dir.name} has no {DATASET_JSONL_NAME}: it is not a finished TracIn run, or it was made by a "
            "version that did not write the dataset-level ranking"
        )
    rows = ranking.page(0, len(ranking))
    top = DEFAULT_TOP if args.top is None and args.percent is None else args.top
    chosen = select_top(rows, args.by, selection_size(len(rows), top, args.percent))
    out = Console(highlight=False)
    how = f"top {args.percent:g}%" if args.percent is not None else f"top {top}"
    default = " (the default; --top K or --percent P)" if args.top is None and args.percent is None else ""
    out.print(
        f"{how}{default} of {len(rows):,} training examples by {args.by} influence over the test set: {len(chosen):,}",
        markup=False,
    )
    if args.out is not None:
        _export(args.out, selection_records(chosen, args.by))
        out.print(f"written to {args.out}", markup=False)
    else:
        out.print(_table(chosen))
    return 0


def _export(path: Path, records: list[dict[str, object]]) -> None:
    if path.suffix == ".jsonl":
        write_jsonl(path, records)
    elif path.suffix == ".csv":
        write_csv(path, records)
    else:
        raise UserError(f"--out {path}: expected a .jsonl or .csv file name")


def _table(rows: list[DatasetRanked]) -> Table:
    table = Table(box=None, pad_edge=False)
    for name in ("rank", "train", "mean", "max", "text", "completion / label"):
        table.add_column(name, no_wrap=name != "text")
    for rank, row in enumerate(rows, 1):
        target = row.completion if row.completion is not None else ("-" if row.label is None else str(row.label))
        table.add_row(
            str(rank),
            str(row.index),
            _score(row.mean),
            _score(row.max),
            Text(_cut(row.text)),
            Text(_cut(target)),
        )
    return table


def _score(value: float | None) -> str:
    return "-" if value is None else f"{value:+.4e}"


def _cut(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= TEXT_WIDTH else text[: TEXT_WIDTH - 1] + "…"
