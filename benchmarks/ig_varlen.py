"""IG over variable-length text through the engine's batches: the cost of meeting new sequence lengths.

A BERT-base classifier (random weights, word-level vocabulary) and 1024 texts of 14-126 words are written to a
temporary directory and loaded the way a run loads them (length-bucketed batches of 32, trimmed to their longest
sample, all 50 steps a chunk, the profile's default precision). Each pass attributes every batch once, timed per
batch. The first pass over a kernel choice meets every length for the first time; the second pass repeats the
same shapes. Rows: the engine's choice (its short_attention kernels), the engine without them (the
memory-efficient SDPA kernel for padded batches) and torch's own (cuDNN first on H100/H200).

    python benchmarks/ig_varlen.py --out benchmarks/results/ig_varlen_h100.md
    python benchmarks/ig_varlen.py --quick     # tiny model on the CPU: checks the script
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ig_bench import device_name, sync

from gpuopt_tui.core.profiles.io import profile_from_data
from gpuopt_tui.jobs.attribution import engine
from gpuopt_tui.jobs.attribution.engine import Settings, attribute_batch
from gpuopt_tui.jobs.attribution.job import plan_batches
from gpuopt_tui.jobs.data import load_dataset, trim_batch
from gpuopt_tui.jobs.device import resolve_device
from gpuopt_tui.jobs.models import load_adapter, to_device
from gpuopt_tui.jobs.short_attention import switched_off


def write_inputs(root: Path, quick: bool, samples: int) -> dict[str, Any]:
    """A saved classifier with its tokenizer and a JSONL of random texts; the profile data that reads them."""
    words = 200 if quick else 30517
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{i}" for i in range(words))]
    small = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
    config = BertConfig(vocab_size=len(vocab), num_labels=2, **(small if quick else {}))
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(root / "model")
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(root / "model")
    rng = random.Random(0)
    longest = 30 if quick else 126
    with open(root / "data.jsonl", "w") as f:
        for i in range(samples):
            text = " ".join(f"w{rng.randrange(words)}" for _ in range(rng.randint(14, longest)))
            f.write(json.dumps({"text": text, "label": i % 2}) + "\n")
    return {
        "kind": "attribution",
        "run": {"device": "cpu" if quick else "auto"},
        "model": {"adapter": "hf", "path": str(root / "model")},
        "data": {"source": "jsonl", "path": str(root / "data.jsonl")},
        "attribution": {"n_samples": samples, "n_steps": 50},
    }


@contextlib.contextmanager
def torch_kernel_choice() -> Iterator[None]:
    """The engine without its kernel choices: torch picks (cuDNN first on H100/H200)."""
    chosen = engine.padded_batch_kernels
    engine.padded_batch_kernels = lambda mask: contextlib.nullcontext()
    try:
        with switched_off():
            yield
    finally:
        engine.padded_batch_kernels = chosen


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU: checks the script")
    parser.add_argument("--out", type=Path, help="markdown results file (and a .json next to it)")
    parser.add_argument("--samples", type=int, default=1024)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    samples = 64 if args.quick else args.samples
    with tempfile.TemporaryDirectory() as tmp:
        profile = profile_from_data(write_inputs(Path(tmp), args.quick, samples), "ig_varlen")
        device = resolve_device(profile.run.device)
        adapter = load_adapter(profile.model, device, Path(tmp) / "cache")
        ds = load_dataset(profile.data, adapter)
        settings = Settings.resolve(profile.attribution, adapter, device, len(ds))
        plan = plan_batches(ds, profile.attribution.batch_size, True)
        planner = settings.planner()
        batches = [to_device(trim_batch(ds.batch(indices), ds.token_fields), device) for indices in plan]

        def one_pass(label: str, choice: Callable[[], contextlib.AbstractContextManager[None]]) -> dict[str, Any]:
            times = []
            with choice():
                for batch in batches:
                    sync(device)
                    start = time.perf_counter()
                    attribute_batch(adapter, batch, settings, planner)
                    sync(device)
                    times.append(time.perf_counter() - start)
            row = {
                "variant": label,
                "samples_per_s": samples / sum(times),
                "median_batch_s": statistics.median(times),
                "slowest_batch_s": max(times),
                "seconds": sum(times),
            }
            print(f"  {label:70s} {row['samples_per_s']:8.2f} samples/s", flush=True)
            return row

        lengths = sorted({int(b["input_ids"].shape[1]) for b in batches})
        meta = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": device_name(device),
            "versions": f"torch {torch.__version__}, transformers {transformers.__version__}",
            "command": "python benchmarks/ig_varlen.py " + shlex.join(sys.argv[1:]),
            "samples": samples,
            "batches": len(batches),
            "lengths": f"{len(lengths)} distinct, {lengths[0]}..{lengths[-1]} tokens",
            "precision": f"{settings.ig.precision}{' weights' if settings.ig.cast_weights else ''}",
        }
        choices = [  # the engine's first pass goes first, so it also pays the process's first-use costs
            ("the engine's choice (short_attention kernels)", contextlib.nullcontext),
            ("the engine without short_attention (memory-efficient kernel for padded batches)", switched_off),
            ("torch's choice", torch_kernel_choice),
        ]
        rows = [one_pass(f"{label}, first pass", choice) for label, choice in choices]
        rows += [one_pass(f"{label}, second pass", choice) for label, choice in choices]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        args.out.write_text(render(meta, rows))
    return 0


def render(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# Integrated Gradients over variable-length text: new sequence lengths",
        "",
        f"- date: {meta['date']}",
        f"- device: {meta['device']}",
        f"- versions: {meta['versions']}",
        f"- command: `{meta['command']}`",
        f"- model: BERT-base (random weights), {meta['samples']} texts of 14-126 words, "
        f"length-bucketed into {meta['batches']} batches of 32 ({meta['lengths']}); 50 gausslegendre steps, all a "
        f"chunk; {meta['precision']}",
        "",
        "| variant | samples/s | median batch s | slowest batch s | total s |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['variant']} | {r['samples_per_s']:.1f} | {r['median_batch_s']:.3f} | {r['slowest_batch_s']:.3f} | "
        f"{r['seconds']:.1f} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
