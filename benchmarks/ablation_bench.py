"""Layer probing speed: spectral feature extraction, the feature cache and MLP probe training.

1. Top-k singular values (k = 10) + standardisation of N samples x L layers of per-sample matrices, by:
   - numpy CPU pipeline (the usual unoptimized baseline): full SVD with U/V per layer stack (np.linalg.svd), top k,
     per-feature standardisation in numpy, result copied to the device;
   - torch full SVD (torch.linalg.svd) / exact singular values (torch.linalg.svdvals) on the device;
   - torch.svd_lowrank with q = k + 10, 4 power iterations, on the device;
   - the engine: representations.svd_topk (exact for small matrices, svd_lowrank otherwise, the factored core
     for LoRA products) + standardisation with training statistics, on the device.
   Shapes: LoRA A factors (rank 16 x 1024, rank 64 x 4096), hidden states (128 tokens x 768), LoRA updates
   B @ A (1024 x 1024 of rank 16). Error: max relative error of the top k against float64 numpy on 64 samples.
   The CPU baseline runs on --before-layers layers and is scaled to L (marked "extrapolated").
2. The feature cache: extracting 5 base representations from a .safetensors file of LoRA factors, first run
   (compute, write entries) against the rerun (verify checksums, memory-map).
3. Probe training: G layers x R seeds of MLP probes on [N, 10] features, fixed epochs (no early stopping):
   batched ensemble in fp32 / bf16 / fp16 autocast, features on the device or streamed from pinned memory, and
   one probe at a time (the usual loop; run on a few probes and scaled).

    python benchmarks/ablation_bench.py --out benchmarks/results/ablation_h100.md   # on the GPU
    python benchmarks/ablation_bench.py --device cpu --scale 0.05                   # the CPU figures
    python benchmarks/ablation_bench.py --quick                                     # seconds, any machine
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors.torch import save_file

from gpuopt_tui.core.feature_cache import FeatureCache
from gpuopt_tui.core.profiles.ablation import BASE_REPRESENTATIONS
from gpuopt_tui.jobs.ablation.features import extract
from gpuopt_tui.jobs.ablation.inputs import files_source
from gpuopt_tui.jobs.ablation.matrices import DenseBatch, LowRankProductBatch, MatrixBatch
from gpuopt_tui.jobs.ablation.probe import FeatureTable, ProbeSettings, Split, fit_standardizer, train_probes
from gpuopt_tui.jobs.ablation.representations import BASES, FeatureSettings

K = 10
TRAIN_SHARE = 0.7
BEFORE = "numpy full SVD (before)"


@dataclass(frozen=True)
class Case:
    name: str
    rows: int
    cols: int
    samples: int
    layers: int
    rank: int = 0  # > 0: a LoRA update B @ A of this rank (rows x cols)


# Sized so that a full run stays within a few minutes on one H100 (the CPU baseline runs on --before-layers).
CASES = (
    Case("LoRA A r=16 x 1024", 16, 1024, 5_000, 24),
    Case("LoRA A r=64 x 4096", 64, 4096, 1_000, 24),
    Case("hidden states 128 x 768", 128, 768, 2_000, 13),
    Case("LoRA B@A 1024 x 1024, r=16", 1024, 1024, 200, 4, rank=16),
)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def scaled(case: Case, scale: float, max_dim: int) -> Case:
    """Fewer samples (and layers below scale 0.25); --quick also caps the matrix sides."""
    samples = max(64, round(case.samples * scale))
    layers = max(2, round(case.layers * min(1.0, scale * 4)))
    rows, cols = min(case.rows, max_dim), min(case.cols, max_dim)
    name = case.name if (rows, cols) == (case.rows, case.cols) else f"{case.name} (capped {rows} x {cols})"
    return Case(name, rows, cols, samples, layers, case.rank)


# --- 1. feature extraction -----------------------------------------------------------------------------------
def make_layer(case: Case, gen: torch.Generator) -> tuple[Tensor, Tensor | None]:
    """One layer's matrices on the CPU: dense [N, rows, cols] with a j^-0.5 spectrum, or LoRA factors."""
    if case.rank:
        up = torch.randn(case.samples, case.rows, case.rank, generator=gen)
        down = torch.randn(case.samples, case.rank, case.cols, generator=gen) / case.cols**0.5
        return up, down
    r = min(case.rows, case.cols)
    scale = torch.arange(1, r + 1, dtype=torch.float32) ** -0.5
    left = torch.randn(case.samples, case.rows, r, generator=gen) * scale
    return left @ torch.randn(case.samples, r, case.cols, generator=gen) / case.cols**0.5, None


Method = Callable[[Tensor, "Tensor | None"], "Tensor | np.ndarray"]  # raw top k of one layer's matrices


def extraction_methods(device: torch.device, chunk: int) -> dict[str, Method]:
    settings = FeatureSettings(top_k=K)

    def on_device(fn: Callable[[Tensor], Tensor]) -> Method:
        def run(x: Tensor, down: Tensor | None) -> Tensor:
            parts = []
            for start in range(0, len(x), chunk):
                dense = x[start : start + chunk].to(device)
                if down is not None:
                    dense = dense @ down[start : start + chunk].to(device)
                parts.append(fn(dense))
            return torch.cat(parts)

        return run

    def before(x: Tensor, down: Tensor | None) -> np.ndarray:
        parts = []
        for start in range(0, len(x), chunk):
            dense = x[start : start + chunk].numpy()
            if down is not None:
                dense = dense @ down[start : start + chunk].numpy()
            parts.append(np.linalg.svd(dense, full_matrices=False)[1][:, :K])
        return np.concatenate(parts)

    def engine(x: Tensor, down: Tensor | None) -> Tensor:
        parts = []
        for start in range(0, len(x), chunk):
            part = x[start : start + chunk].to(device)
            batch: MatrixBatch = (
                LowRankProductBatch(part, down[start : start + chunk].to(device))
                if down is not None
                else DenseBatch(part)
            )
            parts.append(BASES["svd_topk"].compute(batch, settings, "layer"))
        return torch.cat(parts)

    return {
        BEFORE: before,
        "torch.linalg.svd": on_device(lambda d: torch.linalg.svd(d, full_matrices=False)[1][:, :K]),
        "torch.linalg.svdvals": on_device(lambda d: torch.linalg.svdvals(d)[:, :K]),
        "torch.svd_lowrank q=k+10": on_device(lambda d: torch.svd_lowrank(d, q=K + 10, niter=4)[1][:, :K]),
        "engine svd_topk": engine,
    }


def pipeline(method: Method, x: Tensor, down: Tensor | None, device: torch.device) -> Tensor:
    """Top k then standardisation: in numpy for the CPU pipeline (then copied to the device), else on the device."""
    features = method(x, down)
    if isinstance(features, np.ndarray):
        train = features[: int(len(features) * TRAIN_SHARE)]
        return torch.from_numpy((features - train.mean(0)) / (train.std(0) + 1e-8)).to(device)
    mean, std = fit_standardizer(features, torch.arange(int(len(features) * TRAIN_SHARE), device=features.device))
    return (features - mean) / std


def topk_error(method: Method, x: Tensor, down: Tensor | None) -> float:
    """Max relative error of the top k on 64 samples against float64 numpy."""
    x, down = x[:64], None if down is None else down[:64]
    dense = x.double().numpy() if down is None else x.double().numpy() @ down.double().numpy()
    reference = np.linalg.svd(dense, compute_uv=False)[:, :K]
    got = method(x, down)
    got = got if isinstance(got, np.ndarray) else got.double().cpu().numpy()
    return float(np.max(np.abs(got - reference) / reference))


def bench_extraction(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    rows = []
    methods = extraction_methods(device, args.chunk)
    for base_case in CASES:
        case = scaled(base_case, args.scale, args.max_dim)
        gen = torch.Generator().manual_seed(0)
        timings = dict.fromkeys(methods, 0.0)
        layers_run = dict.fromkeys(methods, 0)
        errors: dict[str, float] = {}
        print(f"  {case.name}: {case.samples} samples x {case.layers} layers", flush=True)
        for layer in range(case.layers):
            x, down = make_layer(case, gen)
            for name, method in methods.items():
                if name == BEFORE and layer >= args.before_layers:
                    continue
                if layer == 0:
                    errors[name] = topk_error(method, x, down)  # also the warm-up
                sync(device)
                t0 = time.perf_counter()
                pipeline(method, x, down, device)
                sync(device)
                timings[name] += time.perf_counter() - t0
                layers_run[name] += 1
        before = timings[BEFORE] * case.layers / layers_run[BEFORE]
        for name in methods:
            seconds = timings[name] * case.layers / layers_run[name]
            row = {
                "case": case.name,
                "samples": case.samples,
                "layers": case.layers,
                "method": name,
                "seconds": seconds,
                "extrapolated": layers_run[name] < case.layers,
                "x_before": before / seconds,
                "max_rel_err": errors[name],
            }
            rows.append(row)
            print(
                f"    {name}: {row['seconds']:.3f} s, x{row['x_before']:.1f}, error {row['max_rel_err']:.1e}",
                flush=True,
            )
    return rows


# --- 2. the feature cache ------------------------------------------------------------------------------------
def bench_cache(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    samples, layers = max(64, round(5_000 * args.scale)), max(2, round(24 * min(1.0, args.scale * 4)))
    gen = torch.Generator().manual_seed(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lora_a.safetensors"
        tensors = {f"layer.{i}": torch.randn(samples, 16, 1024, generator=gen) for i in range(layers)}
        save_file({**tensors, "labels": torch.arange(samples) % 2}, path)
        del tensors
        size = path.stat().st_size
        cache = FeatureCache(Path(tmp) / "cache")
        for label in ("first run", "cached rerun"):
            sync(device)
            t0 = time.perf_counter()
            source = files_source(path, "", 0, cache)
            extract(source, BASE_REPRESENTATIONS, source.layers, FeatureSettings(), cache, device, args.chunk)
            sync(device)
            rows.append(
                {
                    "run": label,
                    "samples": samples,
                    "layers": layers,
                    "input_gib": size / 2**30,
                    "seconds": time.perf_counter() - t0,
                    "hits": cache.stats.hits,
                    "misses": cache.stats.misses,
                }
            )
            cache.stats.hits = cache.stats.misses = 0
    rows[1]["speedup"] = rows[0]["seconds"] / rows[1]["seconds"]
    return rows


# --- 3. probe training ---------------------------------------------------------------------------------------
def bench_probes(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    samples, layers, runs = max(200, round(10_000 * args.scale)), max(2, round(24 * min(1.0, args.scale * 4))), 10
    gen = torch.Generator().manual_seed(2)
    labels = torch.randint(2, (samples,), generator=gen)
    features = [(torch.randn(samples, K, generator=gen) + 0.3 * labels[:, None]).numpy() for _ in range(layers)]
    order = torch.randperm(samples, generator=gen)
    n_train, n_val = int(samples * 0.7), int(samples * 0.15)
    split = Split(order[:n_train], order[n_train : n_train + n_val], order[n_train + n_val :])
    base = ProbeSettings(
        hidden_dim=512, dropout=0.5, batch_size=256, max_epochs=args.probe_epochs, patience=10**6, num_runs=runs
    )
    precisions = ["fp32", "bf16", "fp16"] if device.type == "cuda" else ["fp32"]
    rows = []

    def timed(settings: ProbeSettings, arrays: list[np.ndarray], resident: bool) -> float:
        table = FeatureTable(arrays, split.train, device, resident)
        sync(device)
        t0 = time.perf_counter()
        train_probes(table, labels, split, 2, settings)
        sync(device)
        return time.perf_counter() - t0

    probes = layers * runs
    for precision in precisions:
        settings = ProbeSettings(**{**base.__dict__, "precision": precision})
        timed(ProbeSettings(**{**settings.__dict__, "max_epochs": 1}), features[:1], True)  # warm-up
        for label, resident in (("batched ensemble, on device", True), ("batched ensemble, streamed", False)):
            if not resident and device.type != "cuda":
                continue
            rows.append({"method": label, "precision": precision, "seconds": timed(settings, features, resident)})
        one = ProbeSettings(**{**settings.__dict__, "num_runs": 1})
        few = min(args.sequential_probes, probes)
        seconds = sum(timed(one, features[i % layers : i % layers + 1], True) for i in range(few)) * probes / few
        rows.append({"method": f"one probe at a time ({few} run, scaled)", "precision": precision, "seconds": seconds})
    fp32 = next(r["seconds"] for r in rows if r["precision"] == "fp32" and r["method"].startswith("batched"))
    for r in rows:
        r.update(samples=samples, probes=probes, epochs=args.probe_epochs, x_fp32_batched=fp32 / r["seconds"])
    return rows


SECTIONS: dict[str, Callable[[argparse.Namespace, torch.device], list[dict[str, Any]]]] = {
    "extraction": bench_extraction,
    "cache": bench_cache,
    "probes": bench_probes,
}


# --- report --------------------------------------------------------------------------------------------------
def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [
        "# Layer probing benchmark",
        "",
        f"- date: {meta['date']}",
        f"- device: {meta['device']}; host CPU: {meta['cpu']}",
        f"- versions: python {meta['python']}, torch {meta['torch']}, numpy {meta['numpy']}",
        f"- command: `{meta['command']}`",
    ]
    if "extraction" in results:
        lines += extraction_lines(results["extraction"])
    if "cache" in results:
        lines += cache_lines(results["cache"])
    if "probes" in results:
        lines += probe_lines(results["probes"])
    return "\n".join(lines) + "\n"


def extraction_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "## Top-10 singular values + standardisation (per-sample matrices, N samples x L layers)",
        "",
        "| case | N x L | method | seconds | x before | max rel. error |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        mark = " (extrapolated)" if r["extrapolated"] else ""
        lines.append(
            f"| {r['case']} | {r['samples']} x {r['layers']} | {r['method']} | {r['seconds']:.3f}{mark} | "
            f"{r['x_before']:.1f} | {r['max_rel_err']:.1e} |"
        )
    return [
        *lines,
        "",
        "Seconds: top 10 of every layer + standardisation, inputs in host memory. Error: max relative error of",
        "the top 10 on 64 samples of the first layer against float64 numpy.",
    ]


def cache_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "## Feature cache (5 base representations from a .safetensors file of LoRA A factors 16 x 1024)",
        "",
        "| run | N x L | input GiB | seconds | hits | misses | speed-up |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        speedup = f"{r['speedup']:.1f}" if "speedup" in r else "-"
        lines.append(
            f"| {r['run']} | {r['samples']} x {r['layers']} | {r['input_gib']:.2f} | {r['seconds']:.3f} | "
            f"{r['hits']} | {r['misses']} | {speedup} |"
        )
    return lines


def probe_lines(rows: list[dict[str, Any]]) -> list[str]:
    probe = rows[0]
    lines = [
        "",
        f"## Probe training ({probe['probes']} probes = layers x 10 seeds, {probe['samples']} samples x 10 "
        f"features, hidden 512, batch 256, {probe['epochs']} epochs)",
        "",
        "| method | precision | seconds | x batched fp32 |",
        "|---|---|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['method']} | {r['precision']} | {r['seconds']:.3f} | {r['x_fp32_batched']:.2f} |")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: checks the script in seconds")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--scale", type=float, default=1.0, help="samples x scale (layers shrink below 0.25)")
    parser.add_argument("--chunk", type=int, default=1024, help="samples per batch of the extraction")
    parser.add_argument("--before-layers", type=int, default=1, help="layers the CPU baseline runs on")
    parser.add_argument("--probe-epochs", type=int, default=20)
    parser.add_argument("--sequential-probes", type=int, default=4, help="probes of the one-at-a-time loop")
    parser.add_argument("--sections", default="extraction,cache,probes", help="comma-separated parts to run")
    parser.add_argument("--out", type=Path, help="write a markdown results file here (and a .json next to it)")
    args = parser.parse_args(argv)
    args.sections = [part.strip() for part in args.sections.split(",") if part.strip()]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s) {', '.join(sorted(unknown))}; expected some of {', '.join(SECTIONS)}")
    args.max_dim = 1 << 30
    if args.quick:
        args.scale, args.chunk, args.before_layers, args.max_dim = 0.005, 64, 1, 96
        args.probe_epochs, args.sequential_probes = 2, 2
        args.device = "cpu" if args.device == "auto" else args.device
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    print(f"{device_name(device)}", flush=True)
    results: dict[str, Any] = {
        "meta": {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "device": device_name(device),
            "cpu": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
            "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        }
    }
    for name in args.sections:
        print(name, flush=True)
        results[name] = SECTIONS[name](args, device)
    report = markdown(results)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report, encoding="utf-8")
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
