"""What changes the speed of IG's interpolation steps on BERT-base: the engine's lean forward (the last layer for
[CLS] only, attention without a mask for unpadded batches), the attention kernel (the engine's short_attention
or torch's SDPA backends), torch.compile; and where the GPU time of a step goes.

Same model, data and method as ig_bench.py (BERT-base, random weights, seq 128, 50 riemann_right steps, 32
samples x all steps a chunk, bf16 or fp16 weights). Each row is timed after a warm-up (compiling included in
it), best of --repeat; its error is against the engine's fp32 result on the full model. The kernel table sums
GPU time per kernel family under torch.profiler for one chunk of the named rows.

    python benchmarks/ig_variants.py --out benchmarks/results/ig_variants_h100.md
    python benchmarks/ig_variants.py --quick     # tiny model on the CPU: checks the script
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ig_bench import (
    BF16_WEIGHTS,
    FP16_WEIGHTS,
    FP32,
    Mode,
    Setup,
    build_model,
    device_name,
    flops_per_sample_step,
    gemm_rate,
    make_tokens,
    measure,
    ours,
    predicted,
    sync,
)

from gpuopt_tui.jobs.attribution.check import relative_difference
from gpuopt_tui.jobs.attribution.compiled import StepCompiler
from gpuopt_tui.jobs.short_attention import switched_off

#: Kernel families by name (first match wins).
FAMILIES = [
    ("attention", re.compile(r"flash|fmha|attention|cudnn|softmax", re.I)),
    ("GEMM", re.compile(r"gemm|cutlass|xmma|nvjet|sm\d+_", re.I)),
    ("compiled (Triton)", re.compile(r"triton", re.I)),
    ("layer norm", re.compile(r"layer_norm|layernorm", re.I)),
    ("elementwise / copies", re.compile(r"elementwise|vectorized|copy|fill|cat|index|reduce", re.I)),
]


@dataclasses.dataclass
class Variant:
    name: str
    mode: Mode
    backend: str | None = None  # an SDPBackend tried first (the math kernel stays, for the fp32 endpoints)
    profile: bool = False
    torch_attention: bool = False  # torch's SDPA instead of the engine's short_attention kernels


def variants(device: torch.device) -> list[Variant]:
    own = "model's own forward"

    def mode(
        precision: Mode,
        *,
        lean: bool = True,
        unmasked: bool = True,
        compiled: bool = False,
        options: dict[str, Any] | None = None,
    ) -> Mode:
        compiler = StepCompiler(options=options) if compiled or options else None
        return dataclasses.replace(precision, lean=lean, unmasked=unmasked, compiler=compiler)

    if device.type != "cuda":
        return [
            Variant(f"bf16 weights, {own}", mode(BF16_WEIGHTS, lean=False), profile=True),
            Variant("bf16 weights, lean forward, mask kept", mode(BF16_WEIGHTS, unmasked=False)),
            Variant("bf16 weights, lean forward", mode(BF16_WEIGHTS)),
        ]
    bf16, fp16 = BF16_WEIGHTS, FP16_WEIGHTS
    return [
        Variant(f"bf16 weights, {own}", mode(bf16, lean=False), profile=True),
        Variant("bf16 weights, lean forward, mask kept", mode(bf16, unmasked=False)),
        Variant("bf16 weights, lean forward, torch attention", mode(bf16), torch_attention=True, profile=True),
        Variant("bf16 weights, lean forward", mode(bf16), profile=True),
        Variant("bf16 weights, lean forward, SDPA flash", mode(bf16), backend="FLASH_ATTENTION"),
        Variant("bf16 weights, lean forward, SDPA cuDNN", mode(bf16), backend="CUDNN_ATTENTION"),
        Variant("bf16 weights, lean forward, SDPA memory-efficient", mode(bf16), backend="EFFICIENT_ATTENTION"),
        Variant(f"fp16 weights, {own}", mode(fp16, lean=False)),
        Variant("fp16 weights, lean forward", mode(fp16)),
        Variant(f"bf16 weights, compiled, {own}", mode(bf16, lean=False, compiled=True)),
        Variant(
            "bf16 weights, compiled, lean forward, torch attention",
            mode(bf16, compiled=True),
            torch_attention=True,
            profile=True,
        ),
        Variant("bf16 weights, compiled, lean forward", mode(bf16, compiled=True), profile=True),
        Variant(
            "fp16 weights, compiled, lean forward, torch attention", mode(fp16, compiled=True), torch_attention=True
        ),
        Variant("fp16 weights, compiled, lean forward", mode(fp16, compiled=True)),
        Variant(
            "bf16 weights, compiled (coordinate descent tuning), lean forward",
            mode(bf16, options={"coordinate_descent_tuning": True}),
        ),
        Variant("bf16 weights, compiled (CUDA graphs), lean forward", mode(bf16, options={"triton.cudagraphs": True})),
        Variant(
            "bf16 weights, compiled (max-autotune GEMMs), lean forward",
            mode(bf16, options={"max_autotune": True}),
            profile=True,
        ),
    ]


@contextlib.contextmanager
def applied(variant: Variant) -> Iterator[None]:
    """The variant's attention: torch's SDPA instead of the engine's kernels if asked, or a given SDPA backend
    tried first (the math kernel stays, for the fp32 endpoints)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with contextlib.ExitStack() as stack:
        if variant.torch_attention or variant.backend:
            stack.enter_context(switched_off())
        if variant.backend:
            stack.enter_context(sdpa_kernel([getattr(SDPBackend, variant.backend), SDPBackend.MATH], set_priority=True))
        yield


def kernel_families(run: Callable[[], Tensor], device: torch.device) -> dict[str, Any]:
    """For one run: its wall time (timed without the profiler), the GPU time of all its kernels, GPU ms per
    kernel family and the 12 costliest kernels."""
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    start = time.perf_counter()
    run()
    sync(device)
    wall_ms = 1000 * (time.perf_counter() - start)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
        sync(device)
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"] if device.type == "cuda" else []
    total = sum(e.device_time_total for e in kernels) or 1.0
    families: dict[str, float] = {}
    for e in kernels:
        family = next((f for f, pattern in FAMILIES if pattern.search(e.key)), "other")
        families[family] = families.get(family, 0.0) + e.device_time_total
    fam_rows = [
        {"family": f, "gpu_ms": us / 1000, "share": 100 * us / total}
        for f, us in sorted(families.items(), key=lambda kv: -kv[1])
    ]
    top = sorted(kernels, key=lambda e: -e.device_time_total)[:12]
    top_rows = [
        {
            "kernel": e.key[:90],
            "calls": e.count,
            "gpu_ms": e.device_time_total / 1000,
            "share": 100 * e.device_time_total / total,
        }
        for e in top
    ]
    return {"wall_ms": wall_ms, "kernel_ms": total / 1000, "families": fam_rows, "top": top_rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU: checks the script")
    parser.add_argument("--out", type=Path, help="markdown results file (and a .json next to it)")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32, help="samples a chunk (all steps of each)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", help="run only these variants: their names, separated by ';'")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    model = build_model(args.quick, device)
    seq = 32 if args.quick else args.seq
    samples, steps = (8, 8) if args.quick else (args.samples, args.steps)
    gen = torch.Generator().manual_seed(1)
    ids, mask = make_tokens(samples, seq, model.config.vocab_size, gen)
    ids, mask = ids.to(device), mask.to(device)
    target = predicted(model, ids, mask)
    setup = Setup(model, device, ids, mask, target, steps)
    gemm, gemm_dtype = gemm_rate(device, args.quick)
    step_flops = flops_per_sample_step(setup)
    batch = 4 if args.quick else args.batch
    print(
        f"{device_name(device)}: {gemm_dtype} GEMM {gemm / 1e12:.1f} TFLOP/s, {step_flops / 1e9:.2f} GFLOP a sample-step"
    )

    reference = measure("fp32 reference, full model", device, ours(setup, samples, 8, None, FP32), 1).scores
    rows: list[dict[str, Any]] = []
    profiles: dict[str, Any] = {}
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device_name(device),
        "versions": f"torch {torch.__version__}, transformers {transformers.__version__}",
        "command": "python benchmarks/ig_variants.py " + shlex.join(sys.argv[1:]),
        "gemm_tflops": gemm / 1e12,
        "step_gflop": step_flops / 1e9,
        "samples": samples,
        "steps": steps,
        "seq": seq,
        "batch": batch,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    }
    chosen = variants(device)
    if args.only:
        names = [name.strip() for name in args.only.split(";")]
        unknown = [name for name in names if name not in {v.name for v in chosen}]
        if unknown:
            raise SystemExit(f"unknown variants: {unknown}; known: {[v.name for v in chosen]}")
        chosen = [v for v in chosen if v.name in names]
    for variant in chosen:
        run = ours(setup, samples, batch, None, variant.mode)
        try:
            with applied(variant):
                row = measure(variant.name, device, run, args.repeat)
                if variant.profile:
                    profiles[variant.name] = kernel_families(ours(setup, batch, batch, None, variant.mode), device)
        except Exception as exc:  # a backend that cannot run this input: say so, keep going
            print(f"  {variant.name}: failed: {type(exc).__name__}: {exc}"[:300], flush=True)
            rows.append({"variant": variant.name, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
            continue
        error = relative_difference(row.scores, reference[: row.samples])
        rows.append(
            {
                "variant": variant.name,
                "samples_per_s": row.rate,
                "pct_of_limit": 100 * row.rate * steps * step_flops / gemm,
                "peak_gib": row.peak_gib,
                "rel_err_median": float(error.median()),
                "rel_err_max": float(error.max()),
                "compile_s": getattr(variant.mode.compiler, "compile_seconds", None),
            }
        )
        write(args.out, meta, rows, profiles)
    write(args.out, meta, rows, profiles)
    return 0


def write(out: Path | None, meta: dict[str, Any], rows: list[dict[str, Any]], profiles: dict[str, Any]) -> None:
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "profiles": profiles}, indent=1))
    out.write_text(render(meta, rows, profiles))


def render(meta: dict[str, Any], rows: list[dict[str, Any]], profiles: dict[str, Any]) -> str:
    lines = [
        "# Integrated Gradients: step variants",
        "",
        f"- date: {meta['date']}",
        f"- device: {meta['device']}",
        f"- versions: {meta['versions']}",
        f"- command: `{meta['command']}`",
        f"- model: BERT-base (random weights, SDPA attention), {meta['samples']} samples x {meta['seq']} tokens (no "
        f"padding), {meta['steps']} steps riemann_right, {meta['batch']} samples x all steps a chunk"
        + (f"; PYTORCH_CUDA_ALLOC_CONF={meta['alloc_conf']}" if meta.get("alloc_conf") else ""),
        f"- bf16 GEMM measured in this run: {meta['gemm_tflops']:.0f} TFLOP/s; one (sample, step) of the full model: "
        f"{meta['step_gflop']:.2f} GFLOP; % of limit counts the full model's FLOPs for every row, so work skipped "
        "exactly (the last layer for [CLS] only) shows as a higher share",
        "- rel. error: per sample max |a - b| / max |b| of token scores against the fp32 full model; median / max",
        "",
        "| variant | samples/s | % of limit | peak GiB | rel. error (median / max) | compiling s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error']} | | | | |")
            continue
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        comp = f"{r['compile_s']:.0f}" if r.get("compile_s") else ""
        lines.append(
            f"| {r['variant']} | {r['samples_per_s']:.2f} | {r['pct_of_limit']:.1f}% | {peak} | "
            f"{r['rel_err_median']:.1e} / {r['rel_err_max']:.1e} | {comp} |"
        )
    for name, p in profiles.items():
        busy = 100 * p["kernel_ms"] / p["wall_ms"]
        lines += [
            "",
            f"## GPU time of one chunk: {name}",
            "",
            f"Wall time of the chunk (timed without the profiler): {p['wall_ms']:.1f} ms; its kernels' GPU time: "
            f"{p['kernel_ms']:.1f} ms ({busy:.0f}% of the wall time).",
            "",
            "| kernel family | GPU ms | share |",
            "|---|---:|---:|",
        ]
        lines += [f"| {f['family']} | {f['gpu_ms']:.1f} | {f['share']:.1f}% |" for f in p["families"]]
        lines += ["", "| kernel | calls | GPU ms | share |", "|---|---:|---:|---:|"]
        lines += [f"| `{t['kernel']}` | {t['calls']} | {t['gpu_ms']:.1f} | {t['share']:.1f}% |" for t in p["top"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
