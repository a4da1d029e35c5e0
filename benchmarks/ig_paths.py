"""Where Integrated Gradients' error comes from on a fine-tuned classifier: every nested Clenshaw-Curtis level
(5, 9, ..., --top points) of the same texts in strict fp32 and in the engine's fp16, beside a 2000-step
Gauss-Legendre fp32 reference, saved per sample (token scores, F(x), F(baseline), delta) for offline analysis.

The model and texts are those of ig_auto_bench.py (BERT-base fine-tuned on planted words).

    python benchmarks/ig_paths.py --out /tmp/ig_paths.pt          # GPU, ~4 min on an H100
    python benchmarks/ig_paths.py --quick --out /tmp/ig_paths.pt  # tiny model on the CPU
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ig_auto_bench import SPECIAL, build, fine_tune, make_texts, parse_args
from gpuopt_tui.core.profiles.attribution import AttributionSection
from gpuopt_tui.jobs.attribution.engine import Settings, attribute_batch


def run(adapter, texts, args, **attribution) -> dict[str, torch.Tensor]:
    section = AttributionSection(batch_size=args.batch, compile="off", **attribution)
    settings = Settings.resolve(section, adapter, adapter.device, len(texts))
    planner = settings.planner()
    keys = ("token_scores", "deltas", "scores", "baseline_scores", "steps")
    out: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
    for i in range(0, len(texts), args.batch):
        batch = {
            k: v.to(adapter.device) for k, v in adapter.tokenize(texts[i : i + args.batch], args.max_length).items()
        }
        result = attribute_batch(adapter, batch, settings, planner)
        scores = torch.zeros(result["token_scores"].shape[0], args.max_length)
        scores[:, : result["token_scores"].shape[1]] = result["token_scores"]
        out["token_scores"].append(scores)
        for k in keys[1:]:
            out[k].append(result[k])
    return {k: torch.cat(v) for k, v in out.items()}


def main() -> int:
    argv = [a for a in sys.argv[1:] if not a.startswith("--top=")]
    top = next((int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--top=")), 1025)
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    adapter = build(args, device)
    train = fine_tune(adapter, args)
    print(f"accuracy {train['accuracy']:.3f}", flush=True)
    gen = torch.Generator().manual_seed(2)
    filler = args.vocab - len(SPECIAL) - 16
    texts, labels = make_texts(args.samples, args.min_words, args.max_words, filler, gen)
    texts, labels = texts[: args.reference_samples], labels[: args.reference_samples]
    saved: dict[str, object] = {"texts": texts, "labels": labels, "train": train}
    start = time.perf_counter()
    saved["reference"] = run(adapter, texts, args, n_steps=args.reference_steps, use_amp=False, tf32=False)
    print(f"reference {time.perf_counter() - start:.0f} s", flush=True)
    points = 5
    while points <= top:
        for name, extra in (("fp32", {"use_amp": False, "tf32": False}), ("fp16", {})):
            saved[f"cc{points}_{name}"] = run(adapter, texts, args, n_steps=points, method="clenshaw_curtis", **extra)
        print(f"cc {points} {time.perf_counter() - start:.0f} s", flush=True)
        points = 2 * points - 1
    for tol in args.tolerances:
        saved[f"auto{tol:g}"] = run(adapter, texts, args, n_steps="auto", tolerance=tol, max_steps=args.max_steps)
    out = args.out or Path("ig_paths.pt")
    torch.save(saved, out)
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
