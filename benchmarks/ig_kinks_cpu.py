"""IG on a model whose integrand jumps, on the CPU in float64: what 2000 fixed Gauss-Legendre steps and the auto
steps give against the exact integral.

The model: a random DistilBERT-shaped classifier (2 layers, hidden 32, initializer_range 0.3: large weights), whose
head has a ReLU, so that the gradient along the path jumps wherever a unit of it turns on or off. 24 random texts of
5-16 tokens, zero baselines, the predicted class. The exact integral: the auto steps' panels to 1e-8 (thousands
of points a sample, placed at the jumps). Error: per sample max |a - b| / max |b| of the token scores. Float64
throughout, so that no rounding enters the comparison.

    python benchmarks/ig_kinks_cpu.py --out benchmarks/results/ig_kinks_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuopt_tui.jobs.attribution import IGOptions, integrated_gradients
from gpuopt_tui.jobs.attribution.check import relative_difference


def case(seed: int) -> tuple:
    torch.manual_seed(seed)
    config = transformers.DistilBertConfig(
        vocab_size=100, dim=32, n_layers=2, n_heads=4, hidden_dim=64, initializer_range=0.3,
        max_position_embeddings=64, num_labels=2,
    )  # fmt: skip
    model = transformers.DistilBertForSequenceClassification(config).eval().double()
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(5, 100, (24, 16), generator=gen)
    mask = (torch.arange(16)[None] < torch.randint(5, 17, (24,), generator=gen)[:, None]).long()
    emb = model.get_input_embeddings()(ids * mask).detach()
    return (lambda e, m, c: model(inputs_embeds=e, attention_mask=m).logits), emb, mask


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = parser.parse_args()
    lines = [
        "# IG where the integrand jumps: 2000 fixed steps and auto steps against the exact integral (CPU, float64)",
        "",
        f"- date: {datetime.date.today()}; torch {torch.__version__}, transformers {transformers.__version__}",
        f"- command: `{' '.join(['python', *map(shlex.quote, sys.argv)])}`",
        "- model, texts and error: see the script's docstring; exact = auto panels to 1e-8 (float64)",
        "",
        "| seed | rule | mean points | error median / max | samples above the tolerance (GL: 1e-3) | reported within / above it |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for seed in args.seeds:
        forward, emb, mask = case(seed)
        base = torch.zeros_like(emb)
        exact = integrated_gradients(
            forward,
            emb,
            base,
            mask,
            options=IGOptions(n_steps="auto", tolerance=1e-8, max_steps=30000, per_dimension=False),
        )
        target = exact.target
        rows = {
            "2000 Gauss-Legendre steps": integrated_gradients(forward, emb, base, mask, target, IGOptions(n_steps=2000, alpha_batch_size=500, per_dimension=False)),
            "auto, tolerance 1e-2": integrated_gradients(forward, emb, base, mask, target, IGOptions(n_steps="auto", tolerance=1e-2, per_dimension=False)),
            "auto, tolerance 1e-3": integrated_gradients(forward, emb, base, mask, target, IGOptions(n_steps="auto", tolerance=1e-3, per_dimension=False)),
        }  # fmt: skip
        for name, result in rows.items():
            error = relative_difference(result.token_scores(), exact.token_scores())
            tol = 1e-2 if "1e-2" in name else 1e-3
            verdict = "—" if result.within is None else f"{int(result.within.sum())} / {int((~result.within).sum())}"
            lines.append(
                f"| {seed} | {name} | {result.steps.double().mean():.0f} | {error.median():.1e} / {error.max():.1e} | "
                f"{int((error > tol).sum())} | {verdict} |"
            )
            print(lines[-1], flush=True)
        lines.append(f"| {seed} | exact (auto to 1e-8) | {exact.steps.double().mean():.0f} | 0 | | |")
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
