"""Attention alone at IG's shapes: the engine's fused short-sequence kernels against torch's SDPA kernels.

One IG chunk of BERT-base (32 samples x 50 steps = 1600 sequences, 12 heads of 64, 128 tokens) in bf16 and
fp16: forward, and forward + backward to q, k and v, as the lean forward calls them ([batch, seq, heads, dim]
projections; SDPA gets transposed views). Padded rows: random lengths 16..128 with a key mask (SDPA's
memory-efficient kernel, the engine's earlier choice for padded batches, against ours). Times are the median of
--iters CUDA-event timings after a warm-up; GB/s counts each tensor read or written once (q, k, v, out forward;
q, k, v, dO, dq, dk, dv backward). Error: max |a - b| / max |b| of out, dq, dk, dv against float64 on the first
64 sequences.

    python benchmarks/attention_bench.py --sweep --out benchmarks/results/attention_h100.md
    python benchmarks/attention_bench.py --quick     # tiny shapes on the CPU (triton's interpreter)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if "--quick" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuopt_tui.jobs import short_attention as sa
from gpuopt_tui.jobs.short_attention import short_attention

Attention = Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]


def sdpa(backend: str | None) -> Attention:
    """torch's attention on the transposed projections, one backend forced (None: torch's own choice)."""

    def run(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None) -> Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        mask = None if key_mask is None else key_mask[:, None, None, :]
        forced = contextlib.nullcontext() if backend is None else sdpa_kernel([getattr(SDPBackend, backend)])
        with forced:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return out.transpose(1, 2)

    return run


def reference(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, grad: Tensor) -> list[Tensor]:
    """out, dq, dk, dv in float64 by the textbook formula."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    return [out, *torch.autograd.grad(out, (q, k, v), grad.double())]


def time_ms(fn: Callable[[], Any], iters: int, device: torch.device) -> float:
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return 1000 * (time.perf_counter() - start)
    times = []
    for _ in range(iters):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def inputs(
    batch: int, seq: int, heads: int, dim: int, dtype: torch.dtype, padded: bool, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(batch, seq, heads, dim, generator=gen).to(device, dtype) for _ in range(4))
    key_mask = None
    if padded:
        lengths = torch.randint(16, seq + 1, (batch,), generator=gen)
        key_mask = (torch.arange(seq)[None, :] < lengths[:, None]).to(device)
    return q, k, v, key_mask, grad


def measure(name: str, attention: Attention, case: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(case["device"])
    q, k, v, key_mask, grad = inputs(
        case["batch"], case["seq"], case["heads"], case["dim"], case["dtype"], case["padded"], device
    )
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def forward() -> Tensor:
        with torch.no_grad():
            return attention(q, k, v, key_mask)

    def both() -> tuple[Tensor, ...]:
        return torch.autograd.grad(attention(*leaves, key_mask), leaves, grad)

    row: dict[str, Any] = {"case": case["name"], "kernel": name}
    try:
        row["forward_ms"] = time_ms(forward, args.iters, device)
        row["both_ms"] = time_ms(both, args.iters, device)
        n = min(64, case["batch"])
        few = [t[:n].detach().requires_grad_() for t in (q, k, v)]
        few_mask = None if key_mask is None else key_mask[:n]
        out = attention(*few, few_mask)
        got = [out, *torch.autograd.grad(out, few, grad[:n])]
        want = reference(*few, few_mask, grad[:n])
        row["errors"] = [float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip(got, want)]
    except Exception as exc:  # a kernel that cannot take this input: say so, keep going
        row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        return row
    tensor_gb = q.numel() * q.element_size() / 1e9
    row["forward_gbps"] = 4 * tensor_gb / (row["forward_ms"] / 1000)
    row["backward_ms"] = row["both_ms"] - row["forward_ms"]
    row["backward_gbps"] = 7 * tensor_gb / (row["backward_ms"] / 1000) if row["backward_ms"] > 0 else None
    print(f"  {case['name']:<40} {name:<28} fwd {row['forward_ms']:7.2f} ms  fwd+bwd {row['both_ms']:7.2f} ms")
    return row


def cases(quick: bool, device: torch.device) -> list[dict[str, Any]]:
    base = {"batch": 6, "heads": 2, "dim": 16} if quick else {"batch": 1600, "heads": 12, "dim": 64}
    seqs = [(37, False), (37, True)] if quick else [(128, False), (128, True), (64, False)]
    dtypes = [torch.float32] if quick else [torch.bfloat16, torch.float16]
    out = []
    for dtype in dtypes:
        for seq, padded in seqs:
            tag = f"{str(dtype).removeprefix('torch.')}, seq {seq}" + (", key mask 16..seq" if padded else "")
            out.append({**base, "name": tag, "seq": seq, "dtype": dtype, "padded": padded, "device": device.type})
    return out


def kernels(device: torch.device, padded: bool) -> list[tuple[str, Attention]]:
    ours: list[tuple[str, Attention]] = [("ours (short_attention)", short_attention)]
    if device.type != "cuda":
        return [("SDPA math", sdpa("MATH")), *ours]
    if padded:
        return [("SDPA memory-efficient", sdpa("EFFICIENT_ATTENTION")), ("SDPA torch's choice", sdpa(None)), *ours]
    torch_choice = [("SDPA torch's choice", sdpa(None)), ("SDPA flash", sdpa("FLASH_ATTENTION"))]
    return [*torch_choice, ("SDPA memory-efficient", sdpa("EFFICIENT_ATTENTION")), *ours]


def sweep(case: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The engine's kernels alone under each launch setting: forward by warps, backward by warps and rows a step."""
    device = torch.device(case["device"])
    q, k, v, key_mask, grad = (
        t.detach() if t is not None else None
        for t in inputs(case["batch"], case["seq"], case["heads"], case["dim"], case["dtype"], case["padded"], device)
    )
    block = sa.block_size(case["seq"])
    default_fwd, default_bwd = sa.forward_config(case["seq"]), sa.backward_config(case["seq"])
    _, lse = sa.run_forward(q, k, v, key_mask)
    rows = []
    for warps in (2, 4, 8):
        config = {"num_warps": warps}
        ms = time_ms(functools.partial(sa.run_forward, q, k, v, key_mask, **config), args.iters, device)
        rows.append(
            {"case": case["name"], "pass": "forward", "config": config, "ms": ms, "default": config == default_fwd}
        )
    for warps in (2, 4, 8):
        for rows_a_step in (16, 32, 64, 128):
            if rows_a_step > block or (warps == 2 and rows_a_step > 32) or (warps == 8 and rows_a_step < 32):
                continue
            config = {"num_warps": warps, "BLOCK_M": rows_a_step}
            ms = time_ms(functools.partial(sa.run_backward, grad, q, k, v, lse, key_mask, **config), args.iters, device)
            rows.append(
                {"case": case["name"], "pass": "backward", "config": config, "ms": ms, "default": config == default_bwd}
            )
    for r in rows:
        print(f"  {r['case']:<40} {r['pass']:<9} {r['config']} {r['ms']:.3f} ms")
    return rows


def render_sweep(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "## Launch settings of the engine's kernels (--sweep)",
        "",
        "| case | pass | settings | ms | the default |",
        "|---|---|---|---:|---|",
    ]
    for r in rows:
        settings = ", ".join(f"{k}={v}" for k, v in r["config"].items())
        lines.append(f"| {r['case']} | {r['pass']} | {settings} | {r['ms']:.3f} | {'yes' if r['default'] else ''} |")
    return lines


def render(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# Attention at IG's shapes",
        "",
        f"- date: {meta['date']}",
        f"- device: {meta['device']}",
        f"- versions: {meta['versions']}",
        f"- command: `{meta['command']}`",
        "- shapes: [batch, seq, heads, dim] as in the table; median of CUDA-event timings; GB/s counts each tensor "
        "once; error: max |a - b| / max |b| against float64 on the first 64 sequences (out / dq / dk / dv)",
        "",
        "| case | kernel | forward ms | GB/s | fwd+bwd ms | backward GB/s | error (out / dq / dk / dv) |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['kernel']} | failed: {r['error']} | | | | |")
            continue
        bwd = f"{r['backward_gbps']:.0f}" if r.get("backward_gbps") else "-"
        errors = " / ".join(f"{e:.1e}" for e in r["errors"])
        lines.append(
            f"| {r['case']} | {r['kernel']} | {r['forward_ms']:.2f} | {r['forward_gbps']:.0f} | "
            f"{r['both_ms']:.2f} | {bwd} | {errors} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (triton's interpreter)")
    parser.add_argument("--out", type=Path, help="markdown results file (and a .json next to it)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="also time the engine's kernels under launch settings")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (triton interpreter)"
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": name,
        "versions": f"torch {torch.__version__}",
        "command": "python benchmarks/attention_bench.py " + shlex.join(sys.argv[1:]),
    }
    print(name)
    rows = []
    for case in cases(args.quick, device):
        for kernel_name, attention in kernels(device, case["padded"]):
            rows.append(measure(kernel_name, attention, case, args))
    swept = []
    if args.sweep and device.type == "cuda":
        for case in cases(args.quick, device):
            swept += sweep(case, args)
    text = render(meta, rows) + ("\n".join(render_sweep(swept)) + "\n" if swept else "")
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(
            json.dumps({"meta": meta, "rows": rows, "sweep": swept}, indent=1, default=str)
        )
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
