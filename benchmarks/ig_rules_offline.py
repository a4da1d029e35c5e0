"""Step rules of `n_steps = "auto"` compared offline, on integrand profiles saved by ig_profiles.py.

Every rule is applied to the same saved values of g_t(alpha) (strict fp32 on the GPU, BERT-base fine-tuned as in
ig_auto_bench.py, its 128 reference texts), so the comparison is of where the points go, not of the GPU:
- nested Clenshaw-Curtis levels (9, 17, 33, ... points for every sample; the rule `auto` used before): a sample
  stops when its delta and the change of its token scores from the previous level are within the tolerance;
- the engine's adaptive Simpson panels (gpuopt_tui/jobs/attribution/panels.py and adaptive.standing, called
  here as the engine calls them), first pass on 2 or 4 panels.
The former rule's delta test uses the floor of the precision each sample's steps would run in (fp16, or TF32 for
those adaptive.needs_full_precision sends there), as the engine did then; the panels are judged as the engine
judges them now (no floor). The integrand values themselves are fp32, so the 16-bit rounding of the steps is not
part of this comparison (ig_auto_bench.py measures it); results files written before the verdicts became honest
(ig_rules_offline_H100.md) used the floor for the panels too. Error: per sample
max |a - b| / max |b| of the token scores against the profiles' 1025-point Clenshaw-Curtis fp32 integral.
Passes: the refinement passes a batch needs is the most any of its samples needs.

    python benchmarks/ig_rules_offline.py --profiles /tmp/profiles --out benchmarks/results/ig_rules_offline_H100.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuopt_tui.jobs.attribution import panels as panel_rule
from gpuopt_tui.jobs.attribution.adaptive import (
    accumulation_rounding,
    full_precision,
    needs_full_precision,
    precision_floor,
    standing,
)
from gpuopt_tui.jobs.attribution.deltas import output_floor
from gpuopt_tui.jobs.attribution.rules import clenshaw_curtis

CAP = 513


def load(folder: Path) -> tuple[int, list[dict[str, np.ndarray]], str]:
    samples, intervals, where = [], 0, ""
    for path in sorted(folder.glob("profiles_*.pt")):
        saved = torch.load(path)
        intervals, where = saved["intervals"], saved.get("device", "")
        for s in saved["samples"]:
            g = s["g"].double().numpy() * float(s["scale"])
            samples.append(
                {
                    "cc": g[: intervals + 1],
                    "uniform": g[intervals + 1 :],
                    "F": s["F"].double().numpy(),
                    "reference": s["reference"].double().numpy(),
                }
            )
    return intervals, samples, where


def floor_of(sample: dict[str, np.ndarray], n: int, tolerance: float) -> float:
    """The precision floor of the steps this sample would run in: fp16, or its full-precision fallback."""
    f_x, f_b = (torch.tensor([sample["F"][i]]) for i in (n, 0))
    full = bool(needs_full_precision(f_x, f_b, tolerance, "fp16"))
    return precision_floor(full_precision(tolerance) if full else "fp16")


def nested_cc(sample: dict[str, np.ndarray], n: int, tolerance: float) -> tuple[np.ndarray, int, int]:
    """The former rule: token scores, points and passes."""
    floor, ends = floor_of(sample, n, tolerance), (sample["F"][n], sample["F"][0])
    f_x, f_b = (torch.tensor([e]) for e in ends)
    previous, points, passes = None, 5, 0
    while True:
        passes += 1
        scores = clenshaw_curtis(points - 1)[1] @ sample["cc"][:: n // (points - 1)]
        if previous is not None:
            delta = torch.tensor([scores.sum()]) - (f_x - f_b)
            rounding = precision_floor("fp32") * max(map(abs, ends))
            moved = np.abs(scores - previous).max() <= max(tolerance, floor) * np.abs(scores).max() + rounding
            # the former delta test: a tolerance raised to the floor, and an absolute part
            limit = max(tolerance, floor) * (f_x - f_b).abs() + output_floor(f_x, f_b, floor)
            if (moved and bool((delta.abs() <= limit).all())) or 2 * points - 1 > CAP:
                return scores, points, passes
        previous, points = scores, 2 * points - 1


def panels(sample: dict[str, np.ndarray], n: int, tolerance: float) -> tuple[np.ndarray, int, int]:
    """The engine's rule on the uniform grid: token scores, points and passes (or stops where a split would need
    points finer than the grid)."""
    ends = (float(sample["F"][n]), float(sample["F"][0]))
    state, positions, passes = panel_rule.SamplePanels(sample["uniform"].shape[1]), panel_rule.first_positions(), 0
    unit = panel_rule.GRID // n
    while True:
        passes += 1
        state.add(positions, sample["uniform"][positions // unit])
        now = standing(state, ends, tolerance, accumulation_rounding(torch.float32))
        finest = min(width for _, width in state.panels)
        if now.within or state.points + panel_rule.NEW_POINTS > CAP or finest < 8 * unit:
            return state.estimate().scores, state.points, passes
        positions = state.split(now.panel_errors)


def transitions(samples: list[dict[str, np.ndarray]], n: int) -> str:
    """Where along the path the output moves, for the samples whose output moves by at least 1 (logit): the alpha
    at which F(alpha) has made 50% of its change, and the width from 10% to 90% of it."""
    alphas = np.arange(n + 1) / n
    middles, widths = [], []
    for s in samples:
        f = s["F"][n + 1 :]  # on the uniform points
        if abs(f[-1] - f[0]) < 1:
            continue
        share = (f - f[0]) / (f[-1] - f[0])
        at = [alphas[np.argmax(share >= q)] for q in (0.1, 0.5, 0.9)]
        middles.append(at[1])
        widths.append(at[2] - at[0])
    spread = lambda v: f"{min(v):.3f} / {np.median(v):.3f} / {max(v):.3f}"  # noqa: E731
    return (
        f"- where the output moves ({len(middles)} of {len(samples)} texts move by at least 1 logit): the 50% point "
        f"at alpha {spread(middles)} (min / median / max); 10% to 90% of the change within {spread(widths)} of "
        "the path"
    )


def evaluate(name: str, rule, samples, n: int, tolerance: float, batch: int) -> dict[str, object]:
    results = [rule(s, n, tolerance) for s in samples]
    errors = np.array(
        [np.abs(r[0] - s["reference"]).max() / np.abs(s["reference"]).max() for r, s in zip(results, samples)]
    )
    points = np.array([r[1] for r in results])
    passes = np.array([r[2] for r in results])
    batches = [passes[i : i + batch].max() for i in range(0, len(samples), batch)]
    return {
        "rule": name,
        "tolerance": tolerance,
        "mean_points": points.mean(),
        "max_points": int(points.max()),
        "batch_passes": float(np.mean(batches)),
        "err_median": float(np.median(errors)),
        "err_max": float(errors.max()),
        "worst": int(errors.argmax()),
        "worst_points": int(points[errors.argmax()]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profiles", type=Path, required=True, help="the folder ig_profiles.py wrote")
    parser.add_argument("--card", default="NVIDIA H100 80GB HBM3", help="the card the profiles were computed on")
    parser.add_argument("--tolerances", type=float, nargs="+", default=[1e-2, 5e-3, 1e-3])
    parser.add_argument("--batch", type=int, default=32, help="samples per batch, for the passes a batch needs")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    n, samples, _ = load(args.profiles)
    rows = []
    for tolerance in args.tolerances:
        rows.append(evaluate("nested Clenshaw-Curtis", nested_cc, samples, n, tolerance, args.batch))
        for first in (2, 4):
            panel_rule.FIRST_PANELS, panel_rule.MIN_STEPS = first, 4 * first + 1
            rows.append(
                evaluate(f"panels, first pass {4 * first + 1} points", panels, samples, n, tolerance, args.batch)
            )
    lines = [
        "# Step rules of n_steps = auto, offline on saved integrands",
        "",
        f"- profiles: {len(samples)} texts (ig_auto_bench.py's reference texts), {n + 1} Clenshaw-Curtis and {n + 1} "
        f"uniform points each, strict fp32 on {args.card} (benchmarks/ig_profiles.py)",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- cap {CAP} points; passes: mean over batches of {args.batch} of the most passes a sample of the batch needs",
        "- error: per sample max |a - b| / max |b| of the token scores against the 1025-point Clenshaw-Curtis integral",
        transitions(samples, n),
        "",
        "| rule | tolerance | mean points | max points | passes per batch | error median / max | worst text (points) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rule']} | {r['tolerance']:g} | {r['mean_points']:.1f} | {r['max_points']} | "
            f"{r['batch_passes']:.1f} | {r['err_median']:.1e} / {r['err_max']:.1e} | {r['worst']} ({r['worst_points']}) |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
