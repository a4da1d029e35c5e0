"""The traced tier of this tree against Trainer runs measured before: each (case, micro-batch, accumulation) of
`planner_traced.py --recommend` results files traced again here (fake tensors, on this machine's CPU) and its
allocated and reserved figures set beside the peaks that run measured. No GPU needed: what a change to the trace
does to its error against real runs, without running them again.

    python benchmarks/planner_retrace.py benchmarks/results/planner_recommend_all_H200.json ... --out retrace.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner_traced import CASES

from gpuopt_tui.core.planner.measure import probe_request
from gpuopt_tui.core.planner.traced import run_trace, traced_estimate


def measured_runs(files: list[Path]) -> list[tuple[str, int, int, int, int, str]]:
    """(case, micro-batch, accumulation, max_allocated, max_reserved, source) of every run the files measured."""
    found = []
    for path in files:
        data = json.loads(path.read_text())
        for row in data["rows"]:
            entries = [e for e in row["budgets"] if "micro_batch" in e] + [row.get("small") or {}]
            for e in entries:
                run = e.get("run") or {}
                if run.get("max_reserved") and not run.get("oom"):
                    found.append(
                        (
                            row["case"],
                            e["micro_batch"],
                            e["accumulate"],
                            run["max_allocated"],
                            run["max_reserved"],
                            path.name,
                        )
                    )
    return found


def retrace(case_name: str, micro: int, accumulate: int) -> dict[str, Any]:
    case = next(c for c in CASES if c.name == case_name)
    setup = case.setup.with_batch(micro, accumulate)
    est = traced_estimate(run_trace(probe_request(case.config().to_dict(), case.task, setup)), case.task, setup)
    return {"allocated": est.allocated, "reserved": est.reserved}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", type=Path, nargs="+", help="planner_traced.py --recommend results (JSON)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lines = [
        "| case | micro-batch x accumulation | measured allocated / reserved GiB | traced allocated / reserved error | source |",
        "|---|---|---:|---:|---|",
    ]
    for name, micro, acc, allocated, reserved, source in measured_runs(args.files):
        traced = retrace(name, micro, acc)
        errors = f"{traced['allocated'] / allocated - 1:+.2%} / {traced['reserved'] / reserved - 1:+.2%}"
        lines.append(
            f"| {name} | {micro} x {acc} | {allocated / 2**30:.2f} / {reserved / 2**30:.2f} | {errors} | {source} |"
        )
        print(lines[-1], flush=True)
    head = [
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; traced on {platform.machine()} CPU, torch "
        f"{torch.__version__}, transformers {transformers.__version__}",
        f"- command: `{shlex.join(['python', *sys.argv])}`",
        "",
    ]
    text = "\n".join(head + lines) + "\n"
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
