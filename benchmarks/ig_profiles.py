"""The integrand of Integrated Gradients along the path, sampled densely, for designing step rules offline.

For the reference texts of ig_auto_bench.py (same fine-tuned BERT-base, same texts, same selection), in strict
fp32 (no TF32): at every point alpha of two grids on [0, 1], the Clenshaw-Curtis points (1 - cos(j pi / N)) / 2
and the uniform points j / N (N = --intervals, 1024 by default), each token's integrand
    g_t(alpha) = sum_h (x - baseline)_{t,h} * dF/dx_{t,h} (baseline + alpha (x - baseline))
(its integral over [0, 1] is the token's IG score) and the explained output F(alpha). Any rule whose points lie
on these grids (nested Clenshaw-Curtis levels, dyadic panels, composite Simpson/Romberg) can then be applied to
the saved values and its token scores compared, without a GPU. Also saved: the full Clenshaw-Curtis rule's
token scores computed on the GPU in fp32 (the reference of the offline analysis).

The integrand is stored per sample scaled by its largest |g| in fp16 (the scale in fp32), split over --parts
files so that each stays small:

    python benchmarks/ig_profiles.py --out /tmp/profiles          # GPU, ~4 min on an H100
    python benchmarks/ig_profiles.py --quick --out /tmp/profiles  # tiny model on the CPU
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ig_auto_bench import SIGNAL, SPECIAL, build, fine_tune, make_texts, parse_args
from gpuopt_tui.jobs.attention import padded_batch_kernels
from gpuopt_tui.jobs.attribution.baselines import baseline_embeddings, baseline_token_id
from gpuopt_tui.jobs.attribution.rules import clenshaw_curtis
from gpuopt_tui.jobs.models.base import tile_rows


def profile_batch(adapter, texts: list[str], alphas: Tensor, chunk: int, max_length: int) -> dict[str, Tensor]:
    """g [points, B, S], F [points, B], the target [B] and the lengths [B] of one batch."""
    device = adapter.device
    batch = {k: v.to(device) for k, v in adapter.tokenize(texts, max_length).items()}
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        embeds = adapter.word_embeddings()(ids)
        target = adapter.model(**batch).logits.argmax(-1)
    token = baseline_token_id(adapter, "pad", None)
    baselines = baseline_embeddings(adapter, ids, mask, embeds, token, keep_structure=True)
    diff = embeds - baselines
    step_mask = adapter.step_mask(mask)
    context = adapter.encode_context(batch)
    g, f = [], []
    with adapter.logits_only(), padded_batch_kernels(step_mask):
        for start in range(0, alphas.numel(), chunk):
            a = alphas[start : start + chunk].to(device)
            points = (baselines.unsqueeze(0) + a.view(-1, 1, 1, 1) * diff.unsqueeze(0)).flatten(0, 1)
            points.requires_grad_()
            rows = a.numel()
            m = None if step_mask is None else tile_rows(step_mask, rows)
            with torch.enable_grad():
                out = adapter.logits_from_embeds(points, m, tile_rows(context, rows))
                chosen = out.gather(1, tile_rows(target, rows).unsqueeze(1)).squeeze(1)
                (grads,) = torch.autograd.grad(chosen.sum(), points)
            g.append((grads.view(rows, *diff.shape) * diff).sum(-1).detach())
            f.append(chosen.detach().view(rows, -1))
    return {"g": torch.cat(g), "F": torch.cat(f), "target": target, "lengths": mask.sum(1)}


def main() -> int:
    argv = [a for a in sys.argv[1:] if not a.startswith(("--intervals=", "--parts=", "--chunk="))]
    opts = dict(a[2:].split("=") for a in sys.argv[1:] if a.startswith(("--intervals=", "--parts=", "--chunk=")))
    intervals, parts, chunk = int(opts.get("intervals", 1024)), int(opts.get("parts", 4)), int(opts.get("chunk", 32))
    args = parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    adapter = build(args, device)
    train = fine_tune(adapter, args)
    print(f"accuracy {train['accuracy']:.3f} after {train['steps']} steps", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    gen = torch.Generator().manual_seed(2)
    texts, _ = make_texts(args.samples, args.min_words, args.max_words, args.vocab - len(SPECIAL) - 2 * SIGNAL, gen)
    lengths = [len(adapter.tokenizer.tokenize(t)) + 2 for t in texts]
    texts = [texts[i] for i in sorted(range(len(texts)), key=lambda i: -lengths[i])]
    stride = max(1, len(texts) // args.reference_samples)
    texts = texts[::stride][: args.reference_samples]  # ig_auto_bench.py's reference texts, in its order

    cc_alphas, cc_weights = (torch.as_tensor(v, dtype=torch.float32) for v in clenshaw_curtis(intervals))
    uniform = torch.arange(intervals + 1, dtype=torch.float32) / intervals
    alphas = torch.cat([cc_alphas, uniform])
    samples: list[dict[str, Tensor]] = []
    start = time.perf_counter()
    for i in range(0, len(texts), args.batch):
        out = profile_batch(adapter, texts[i : i + args.batch], alphas, chunk, args.max_length)
        reference = torch.einsum("p,pbs->bs", cc_weights.to(device), out["g"][: intervals + 1])
        for b, length in enumerate(out["lengths"].tolist()):
            g = out["g"][:, b, :length]
            scale = g.abs().amax().clamp_min(1e-30)
            samples.append(
                {
                    "g": (g / scale).half().cpu(),  # [points, length]
                    "scale": scale.float().cpu(),
                    "F": out["F"][:, b].float().cpu(),
                    "reference": reference[b, :length].float().cpu(),
                    "target": out["target"][b].cpu(),
                }
            )
        print(f"  {len(samples)} texts, {time.perf_counter() - start:.0f} s", flush=True)
    target = args.out or Path("ig_profiles")
    target.mkdir(parents=True, exist_ok=True)
    per_part = -(-len(samples) // parts)
    for p in range(parts):
        torch.save(
            {"intervals": intervals, "train": train, "samples": samples[p * per_part : (p + 1) * per_part]},
            target / f"profiles_{p}.pt",
        )
    print(f"wrote {parts} files to {target}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
