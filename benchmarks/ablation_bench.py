"""Layer probing speed: spectral feature extraction, the feature cache and MLP probe training.

1. Top-k singular values (k = 10) + standardisation of N samples x L layers of per-sample matrices, one section per
   shape: extraction:lora16 (LoRA A factors, rank 16 x 1024), extraction:lora64 (rank 64 x 4096),
   extraction:hidden (hidden states, 128 tokens x 768), extraction:product (LoRA updates B @ A, 1024 x 1024 of
   rank 16); "extraction" runs all four. Methods:
   - numpy CPU pipeline (the usual unoptimized baseline): full SVD with U/V (np.linalg.svd), top k, per-feature
     standardisation in numpy, result copied to the device;
   - torch full SVD (torch.linalg.svd), exact singular values (torch.linalg.svdvals), torch.svd_lowrank with
     q = k + 10 and 4 power iterations, on the device;
   - dense shapes: float64 Gram matrix of the short side + torch.linalg.eigvalsh on the device, and (CUDA) with
     the eigenvalues solved on the host CPU; LoRA products: QR factorisations of the factors + svdvals of the core;
   - the engine: representations.svd_topk (the Gram path up to a short side of 64, svd_lowrank above, factored
     Gram matrices for LoRA products) + standardisation with training statistics, on the device.
   Error: max relative error of the top k against numpy's float64 SVD of the same float32 matrices.
   Each method runs layer by layer, a chunk of samples at a time, until it has covered every layer or spent
   --method-budget seconds (the numpy baseline: at most --before-layers layers); its time is then scaled from
   the samples it covered to N x L (marked "extrapolated"), so a section's time stays bounded on any device.
2. The feature cache: extracting 5 base representations from a .safetensors file of LoRA factors, first run
   (compute, write entries) against the rerun (verify checksums, memory-map).
3. Probe training: G layers x R seeds of MLP probes on [N, 10] features, fixed epochs (no early stopping):
   batched ensemble in fp32 / bf16 / fp16 autocast, features on the device or streamed from pinned memory, and
   one probe at a time (the usual loop; run on a few probes and scaled).

The results (markdown, and JSON next to it) are written after each section, so an interrupted run keeps the
finished ones; --append keeps the other sections already in the --out file (one command per section).

    python benchmarks/ablation_bench.py --sections extraction:lora16 --append --out benchmarks/results/ablation_h100.md
    python benchmarks/ablation_bench.py --device cpu --scale 0.05 --out benchmarks/results/ablation_cpu.md
    python benchmarks/ablation_bench.py --quick                                     # seconds, any machine
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors.torch import save_file

from gpuopt_tui.core.atomic import atomic_write_text, write_json
from gpuopt_tui.core.caches.features import FeatureCache
from gpuopt_tui.core.profiles.ablation import BASE_REPRESENTATIONS
from gpuopt_tui.jobs.ablation.features import extract
from gpuopt_tui.jobs.ablation.inputs import files_source
from gpuopt_tui.jobs.ablation.matrices import CUDA_BATCHED_EIGH_MAX, GRAM_MAX_SIDE, DenseBatch, LowRankProductBatch
from gpuopt_tui.jobs.ablation.probe import FeatureTable, ProbeSettings, Split, fit_standardizer, train_probes
from gpuopt_tui.jobs.ablation.representations import BASES, FeatureSettings

K = 10
TRAIN_SHARE = 0.7
BEFORE = "numpy full SVD on the CPU (before)"
CHUNK_ELEMENTS = 1 << 26  # matrix entries of one chunk at most (256 MB in float32)
FIRST_CHUNK = 4  # samples of a method's first call; later calls grow while one stays under a quarter of the budget
ERROR_ELEMENTS = 1 << 22  # matrix entries the error is measured on (64 samples at most, 4 at least)
RESULTS_FORMAT = 2


@dataclass(frozen=True)
class Case:
    name: str
    rows: int
    cols: int
    samples: int
    layers: int
    rank: int = 0  # > 0: a LoRA update B @ A of this rank (rows x cols)


# Sizes at scale 1. The methods' budget bounds a section's time: each method runs --method-budget seconds and at
# most one call (a quarter of the budget) more, so 6-7 methods take about 1.25 x 7 x 5 s = 45 s at the default,
# plus generating the layers and measuring the errors.
CASES = {
    "lora16": Case("LoRA A r=16 x 1024", 16, 1024, 5_000, 24),
    "lora64": Case("LoRA A r=64 x 4096", 64, 4096, 1_000, 24),
    "hidden": Case("hidden states 128 x 768", 128, 768, 2_000, 13),
    "product": Case("LoRA B@A 1024 x 1024, r=16", 1024, 1024, 200, 4, rank=16),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def host_cpu() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    threads = os.environ.get("OMP_NUM_THREADS")
    omp = f", OMP_NUM_THREADS={threads}" if threads else ""
    return f"{model}, {os.cpu_count()} logical CPUs, torch threads {torch.get_num_threads()}{omp}"


def scaled(case: Case, scale: float, max_dim: int) -> Case:
    """Fewer samples (and layers below scale 0.25); --quick also caps the matrix sides."""
    samples = max(64, round(case.samples * scale))
    layers = max(2, round(case.layers * min(1.0, scale * 4)))
    rows, cols = min(case.rows, max_dim), min(case.cols, max_dim)
    name = case.name if (rows, cols) == (case.rows, case.cols) else f"{case.name} (capped {rows} x {cols})"
    return Case(name, rows, cols, samples, layers, case.rank)


# --- 1. feature extraction -----------------------------------------------------------------------------------
Method = Callable[[Tensor, "Tensor | None"], "Tensor | np.ndarray"]  # top k of a chunk of one layer's matrices


def make_layer(case: Case, layer: int, device: torch.device, chunk: int) -> tuple[Tensor, Tensor | None]:
    """One layer's matrices, generated on the device and kept in host memory: dense [N, rows, cols] with a j^-0.5
    spectrum, or LoRA factors up [N, rows, rank] and down [N, rank, cols]."""
    gen = torch.Generator(device=device).manual_seed(layer)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    if case.rank:
        up, down = randn(case.samples, case.rows, case.rank), randn(case.samples, case.rank, case.cols)
        return up.cpu(), (down / case.cols**0.5).cpu()
    r = min(case.rows, case.cols)
    scale = torch.arange(1, r + 1, dtype=torch.float32, device=device) ** -0.5
    x = torch.empty(case.samples, case.rows, case.cols)
    for start in range(0, case.samples, chunk):
        n = len(x[start : start + chunk])
        x[start : start + n] = ((randn(n, case.rows, r) * scale) @ randn(n, r, case.cols) / case.cols**0.5).cpu()
    return x, None


def engine_path(case: Case, device: torch.device) -> str:
    """Which way representations.svd_topk takes for this shape."""
    side = case.rank or min(case.rows, case.cols)
    if side > GRAM_MAX_SIDE:
        return "svd_lowrank" if side > K + 10 else "svdvals"
    solver = "host CPU" if device.type == "cuda" and side > CUDA_BATCHED_EIGH_MAX else processor(device)
    return f"{'factored ' if case.rank else ''}Gram, eigvalsh on the {solver}"


def processor(device: torch.device) -> str:
    return "GPU" if device.type == "cuda" else "CPU"


def gram_topk(dense: Tensor, solver: torch.device) -> Tensor:
    """The comparison Gram method: float64 Gram matrix of the short side, eigenvalues solved on `solver`."""
    d = dense.double()
    gram = d @ d.mT if d.shape[-2] <= d.shape[-1] else d.mT @ d
    values = torch.linalg.eigvalsh(gram.to(solver)).to(dense.device).flip(-1)[:, :K]
    return values.clamp_min(0).sqrt().to(dense.dtype)


def extraction_methods(case: Case, device: torch.device) -> dict[str, Method]:
    settings = FeatureSettings(top_k=K)

    def on_device(fn: Callable[[Tensor], Tensor]) -> Method:
        def run(x: Tensor, down: Tensor | None) -> Tensor:
            dense = x.to(device)
            return fn(dense if down is None else dense @ down.to(device))

        return run

    def before(x: Tensor, down: Tensor | None) -> np.ndarray:
        dense = x.numpy() if down is None else x.numpy() @ down.numpy()
        return np.linalg.svd(dense, full_matrices=False)[1][:, :K]

    def qr_core(up: Tensor, down: Tensor | None) -> Tensor:
        """LoRA products without forming them, by QR factorisations of the factors (the engine above rank 64)."""
        assert down is not None
        r_up = torch.linalg.qr(up.to(device), mode="r").R
        r_down = torch.linalg.qr(down.to(device).mT, mode="r").R
        return torch.linalg.svdvals(r_up @ r_down.mT)[:, :K]

    def engine(x: Tensor, down: Tensor | None) -> Tensor:
        batch = DenseBatch(x.to(device)) if down is None else LowRankProductBatch(x.to(device), down.to(device))
        return BASES["svd_topk"].compute(batch, settings, "layer")

    methods: dict[str, Method] = {
        BEFORE: before,
        "torch.linalg.svd": on_device(lambda d: torch.linalg.svd(d, full_matrices=False)[1][:, :K]),
        "torch.linalg.svdvals": on_device(lambda d: torch.linalg.svdvals(d)[:, :K]),
        "torch.svd_lowrank q=k+10": on_device(lambda d: torch.svd_lowrank(d, q=K + 10, niter=4)[1][:, :K]),
    }
    if case.rank:  # the factored path the engine takes above rank 64 (a formed product's Gram matrix is no shortcut)
        methods["factored, QR core + svdvals"] = qr_core
    else:
        methods[f"Gram float64 + eigvalsh on the {processor(device)}"] = on_device(partial(gram_topk, solver=device))
        if device.type == "cuda":
            host = torch.device("cpu")
            methods["Gram float64 + eigvalsh on the host CPU"] = on_device(partial(gram_topk, solver=host))
    methods[f"engine svd_topk ({engine_path(case, device)})"] = engine
    return methods


def standardise(parts: list[Tensor] | list[np.ndarray], device: torch.device) -> Tensor:
    """Standardisation with training statistics: in numpy for the CPU pipeline (then copied to the device), else
    on the device."""
    if isinstance(parts[0], np.ndarray):
        features = np.concatenate(parts)
        train = features[: int(len(features) * TRAIN_SHARE)]
        return torch.from_numpy((features - train.mean(0)) / (train.std(0) + 1e-8)).to(device)
    features = torch.cat(parts)
    mean, std = fit_standardizer(features, torch.arange(int(len(features) * TRAIN_SHARE), device=features.device))
    return (features - mean) / std


@dataclass
class Tally:
    seconds: float = 0.0
    samples: int = 0  # matrices covered, over all layers
    stopped: bool = False  # budget spent or layer limit reached
    chunk: int = FIRST_CHUNK  # samples of the next call
    largest: int = 0  # samples of the largest call so far


def run_layer(
    method: Method, x: Tensor, down: Tensor | None, chunk: int, device: torch.device, tally: Tally, budget: float
) -> None:
    """Top k of one layer's matrices, at most `chunk` samples a call, then standardisation; stops once `budget`
    is spent. Calls grow from FIRST_CHUNK samples while one stays under a quarter of the budget, so that a slow
    method overruns its budget by little."""
    parts = []
    start = 0
    while start < len(x):
        stop = start + min(tally.chunk, chunk)
        sync(device)
        t0 = time.perf_counter()
        parts.append(method(x[start:stop], None if down is None else down[start:stop]))
        sync(device)
        seconds = time.perf_counter() - t0
        n = len(parts[-1])
        tally.seconds += seconds
        tally.samples += n
        tally.largest = max(tally.largest, n)
        if tally.seconds >= budget:
            tally.stopped = True
            return
        tally.chunk = max(1, min(chunk, int(budget / 4 * n / max(seconds, 1e-6))))
        start = stop
    t0 = time.perf_counter()
    standardise(parts, device)
    sync(device)
    tally.seconds += time.perf_counter() - t0


def topk_errors(methods: dict[str, Method], case: Case, x: Tensor, down: Tensor | None) -> dict[str, float]:
    """Max relative error of each method's top k on the first samples of a layer against numpy's float64 SVD of
    the same float32 matrices (also each method's warm-up)."""
    n = max(4, min(64, ERROR_ELEMENTS // (case.rows * case.cols)))
    x, down = x[:n], None if down is None else down[:n]
    dense = x.double().numpy() if down is None else x.double().numpy() @ down.double().numpy()
    reference = np.linalg.svd(dense, compute_uv=False)[:, :K]
    errors = {}
    for name, method in methods.items():
        got = method(x, down)
        got = got if isinstance(got, np.ndarray) else got.double().cpu().numpy()
        errors[name] = float(np.max(np.abs(got - reference) / reference))
    return errors


def bench_extraction(args: argparse.Namespace, device: torch.device, shape: str) -> list[dict[str, Any]]:
    case = scaled(CASES[shape], args.scale, args.max_dim)
    entries = case.rows * case.cols
    chunk = max(1, min(args.chunk, CHUNK_ELEMENTS // entries))
    methods = extraction_methods(case, device)
    tallies = {name: Tally() for name in methods}
    errors: dict[str, float] = {}
    print(f"  {case.name}: {case.samples} samples x {case.layers} layers, chunks of {chunk}", flush=True)
    for layer in range(case.layers):
        if all(t.stopped for t in tallies.values()):
            break
        x, down = make_layer(case, layer, device, chunk)
        if layer == 0:
            errors = topk_errors(methods, case, x, down)
        for name, method in methods.items():
            tally = tallies[name]
            tally.stopped |= name == BEFORE and layer >= args.before_layers
            if not tally.stopped:
                run_layer(method, x, down, chunk, device, tally, args.method_budget)
    total = case.samples * case.layers
    before = tallies[BEFORE].seconds * total / tallies[BEFORE].samples
    rows = []
    for name, tally in tallies.items():
        seconds = tally.seconds * total / tally.samples
        row = {
            "case": case.name,
            "samples": case.samples,
            "layers": case.layers,
            "largest_call": tally.largest,
            "method": name,
            "seconds": seconds,
            "measured_samples": tally.samples,
            "extrapolated": tally.samples < total,
            "x_before": before / seconds,
            "max_rel_err": errors[name],
        }
        rows.append(row)
        print(
            f"    {name}: {seconds:.3f} s ({tally.samples}/{total} measured), x{row['x_before']:.1f}, "
            f"error {row['max_rel_err']:.1e}",
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


Section = Callable[[argparse.Namespace, torch.device], list[dict[str, Any]]]
SECTIONS: dict[str, Section] = {
    **{f"extraction:{shape}": partial(bench_extraction, shape=shape) for shape in CASES},
    "cache": bench_cache,
    "probes": bench_probes,
}
ALIASES = {"extraction": [f"extraction:{shape}" for shape in CASES]}


# --- report --------------------------------------------------------------------------------------------------
def markdown(sections: dict[str, dict[str, Any]]) -> str:
    lines = ["# Layer probing benchmark"]
    for name in SECTIONS:
        if name not in sections:
            continue
        meta, rows = sections[name]["meta"], sections[name]["rows"]
        if name.startswith("extraction:"):
            lines += extraction_lines(name, rows)
        elif name == "cache":
            lines += cache_lines(rows)
        else:
            lines += probe_lines(rows)
        lines += [
            "",
            f"- {meta['date']}; device: {meta['device']}; host CPU: {meta['cpu']}; section time {meta['wall_s']} s",
            f"- python {meta['python']}, torch {meta['torch']}, numpy {meta['numpy']}; command: `{meta['command']}`",
        ]
    if any(name.startswith("extraction:") for name in sections):
        lines += [
            "",
            "Extraction: seconds for the top 10 of every layer + standardisation, inputs in host memory (copied to",
            "the device a call at a time). A method's calls start at 4 samples and grow, up to the chunk, while one",
            'stays under a quarter of its time budget ("largest call"). A method measured on fewer than N x L',
            'samples (its time budget or the numpy baseline\'s layer limit) is scaled to N x L: "extrapolated".',
            "Error: max relative error of the top 10 on the first samples of the first layer against numpy's",
            "float64 SVD of the same float32 matrices.",
        ]
    return "\n".join(lines) + "\n"


def extraction_lines(name: str, rows: list[dict[str, Any]]) -> list[str]:
    first = rows[0]
    lines = [
        "",
        f"## Top-10 singular values + standardisation: {first['case']}, N x L = {first['samples']} x "
        f"{first['layers']} (`{name}`)",
        "",
        "| method | seconds | measured samples | largest call | x before | max rel. error |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    total = first["samples"] * first["layers"]
    for r in rows:
        mark = " (extrapolated)" if r["extrapolated"] else ""
        lines.append(
            f"| {r['method']} | {r['seconds']:.3f}{mark} | {r['measured_samples']} / {total} | {r['largest_call']} | "
            f"{r['x_before']:.1f} | {r['max_rel_err']:.1e} |"
        )
    return lines


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


def load_sections(out: Path) -> dict[str, dict[str, Any]]:
    """The sections already in `out`'s JSON (--append); none when it is missing or of another format."""
    path = out.with_suffix(".json")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != RESULTS_FORMAT:
        print(f"{path}: not a results file of this benchmark (format {RESULTS_FORMAT}); starting a new one")
        return {}
    return dict(data["sections"])


def save(out: Path, sections: dict[str, dict[str, Any]]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, markdown(sections))
    write_json(out.with_suffix(".json"), {"format": RESULTS_FORMAT, "sections": sections})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: checks the script in seconds")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--scale", type=float, default=1.0, help="samples x scale (layers shrink below 0.25)")
    parser.add_argument("--chunk", type=int, default=1024, help="samples per batch of the extraction, at most")
    parser.add_argument("--before-layers", type=int, default=1, help="layers the CPU baseline runs on, at most")
    parser.add_argument("--method-budget", type=float, default=5.0, help="seconds an extraction method runs, at most")
    parser.add_argument("--probe-epochs", type=int, default=20)
    parser.add_argument("--sequential-probes", type=int, default=4, help="probes of the one-at-a-time loop")
    names = ", ".join([*SECTIONS, *ALIASES])
    parser.add_argument("--sections", default="extraction,cache,probes", help=f"comma-separated, of: {names}")
    parser.add_argument("--out", type=Path, help="write a markdown results file here (and a .json next to it)")
    parser.add_argument("--append", action="store_true", help="keep the other sections already in the --out file")
    args = parser.parse_args(argv)
    sections: list[str] = []
    for part in (p.strip() for p in args.sections.split(",")):
        if part in ALIASES:
            sections += ALIASES[part]
        elif part in SECTIONS:
            sections.append(part)
        elif part:
            parser.error(f"unknown section {part!r}; expected some of {names}")
    args.sections = list(dict.fromkeys(sections))
    args.max_dim = 1 << 30
    if args.quick:
        args.scale, args.chunk, args.before_layers, args.max_dim, args.method_budget = 0.005, 64, 1, 96, 2.0
        args.probe_epochs, args.sequential_probes = 2, 2
        args.device = "cpu" if args.device == "auto" else args.device
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    print(f"{device_name(device)}; host CPU: {host_cpu()}", flush=True)
    sections = load_sections(args.out) if args.out and args.append else {}
    for name in args.sections:
        print(name, flush=True)
        meta = {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": device_name(device),
            "cpu": host_cpu(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
            "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        }
        t0 = time.perf_counter()
        rows = SECTIONS[name](args, device)
        meta["wall_s"] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {meta['wall_s']} s", flush=True)
        sections[name] = {"meta": meta, "rows": rows}
        if args.out:
            save(args.out, sections)  # after every section: an interrupted run keeps the finished ones
    print(markdown(sections))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
