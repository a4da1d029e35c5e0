"""How much of a causal-LM TracIn run's forward and backward goes to padding: the share that packing short
examples into long rows would save.

TracIn scores the training rows longest first by all their tokens (jobs/tracin/scores.py, `TextDataset.tokens`),
cuts each micro-batch's trailing padding per field (jobs/data.trim_batch) and runs [prompt | completion] with each
row's real tokens first, the sequence trimmed to the micro-batch's longest row
(jobs/models/causal_lm.sequence_layout). This script builds prompt and completion masks of seeded length
distributions, puts them through those same functions, and reports

    padding share = 1 - real tokens / (rows x sequence length), summed over the micro-batches

for micro-batches of several sizes, in the engine's order, in the order the engine used before (by the prompt's
tokens alone) and in the data's own order, and with the sequence the engine ran before the layout above (prompt
length + completion length of the micro-batch, each trimmed alone). Packing would bring the share to about 0 (less the tail of its last row). No model runs: the figures are
exact counts for the distributions, not timings, and the distributions are synthetic (named below), not a real
dataset's.

    python benchmarks/tracin_padding_share.py --out benchmarks/results/tracin_padding_share_cpu.md
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuopt_tui.jobs.data import TextDataset, trim_batch
from gpuopt_tui.jobs.models.causal_lm import sequence_layout
from gpuopt_tui.jobs.tracin.scores import _scored_rows

FIELDS = {"input_ids": "attention_mask", "completion_ids": "completion_mask"}


def lognormal(n: int, median: float, sigma: float, low: int, high: int, gen: torch.Generator) -> torch.Tensor:
    values = torch.exp(torch.randn(n, generator=gen, dtype=torch.float64) * sigma) * median
    return values.round().clamp(low, high).long()


def distributions(n: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, str]]:
    """name -> (prompt lengths, completion lengths, how they are drawn)."""
    gen = torch.Generator().manual_seed(seed)
    bench = torch.randint(335, 447, (n,), generator=gen) + 2  # tracin_lm_bench.py: words, the marker and BOS
    return {
        "tracin_lm_bench rows": (bench, torch.full((n,), 64), "prompts of 337-448 tokens, completions of 64"),
        "instruction-like": (
            lognormal(n, 60, 1.0, 4, 1024, gen),
            lognormal(n, 120, 0.9, 1, 1024, gen),
            "prompts lognormal (median 60 tokens, sigma 1.0, 4-1024), completions lognormal (median 120, sigma 0.9, "
            "1-1024), drawn apart",
        ),
    }


def dataset(prompt: torch.Tensor, completion: torch.Tensor) -> TextDataset:
    """Right-padded masks (and ids of ones) of these lengths, as the causal LM adapter tokenizes rows."""

    def masks(lengths: torch.Tensor) -> torch.Tensor:
        return (torch.arange(int(lengths.max()))[None, :] < lengths[:, None]).long()

    p, c = masks(prompt), masks(completion)
    tensors = {"input_ids": p.clone(), "attention_mask": p, "completion_ids": c.clone(), "completion_mask": c}
    return TextDataset(tensors, [""] * len(prompt), dict(FIELDS), "train", {})


def shares(ds: TextDataset, rows: list[int], size: int) -> tuple[float, float]:
    """(padding share with the engine's layout, with prompt + completion lengths) over micro-batches of `size`."""
    real = laid = summed = 0
    for start in range(0, len(rows), size):
        batch = trim_batch({k: v[rows[start : start + size]] for k, v in ds.tensors.items()}, FIELDS)
        _, mask, _ = sequence_layout(batch["attention_mask"], batch["completion_mask"], trim=True)
        real += int(mask.sum())
        laid += mask.numel()
        summed += mask.shape[0] * (batch["attention_mask"].shape[1] + batch["completion_mask"].shape[1])
    return 1 - real / laid, 1 - real / summed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--sizes", default="8,32,128", help="micro-batch sizes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lines = [
        "# Padding in causal-LM TracIn micro-batches: what packing would save",
        "",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; exact counts, no model (any machine gives these "
        f"figures); torch {torch.__version__}",
        f"- command: `python benchmarks/tracin_padding_share.py {' '.join(sys.argv[1:])}`".rstrip(),
        f"- {args.rows} rows per distribution (seed {args.seed}); padding share = 1 - real tokens / (rows x sequence "
        "length) over all micro-batches",
        "",
    ]
    for name, (prompt, completion, how) in distributions(args.rows, args.seed).items():
        ds = dataset(prompt, completion)
        by_prompt = torch.sort(-ds.lengths(), stable=True).indices.tolist()
        orders = {
            "all tokens, longest first (the engine's)": _scored_rows(ds, None, None),
            "prompt tokens, longest first (the engine before)": by_prompt,
            "the data's own": list(range(len(ds))),
        }
        lines += [
            f"## {name}: {how}",
            "",
            "| order | micro-batch | padding share, real tokens first (the engine) | padding share, prompt + "
            "completion lengths (the layout before) |",
            "|---|---:|---:|---:|",
        ]
        for order, rows in orders.items():
            for size in (int(s) for s in args.sizes.split(",")):
                now, before = shares(ds, rows, size)
                lines.append(f"| {order} | {size} | {now:.1%} | {before:.1%} |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
