"""Which training recipe leaves the TracIn benchmarks' BERT with checkpoints that learned the task.

TracIn's agreement figures only describe a trained model: at checkpoints left at chance, every training
example's gradient points nearly the same way and the scores' ranks within each sign are rounding noise
(benchmarks/results/tracin_faithfulness_cpu.md). This trains the benchmark's model (tracin_bench.build's data
and training loop) under each recipe given, in order, and records each checkpoint's accuracy on the rows it was
trained on and on held-out clean rows (those of tracin_projected_bench.py). With --stop-at it stops at the first
recipe whose last checkpoint reaches that held-out accuracy. With --checkpoint-cache the checkpoints stay there,
under the key tracin_bench uses, so that a benchmark run with the same recipe reuses them.

A recipe is FIT:EPOCHS:LR (training examples, epochs, AdamW's peak learning rate), e.g. 20480:3:1e-4.

    python benchmarks/tracin_training_recipes.py --model base --recipes 20480:3:1e-4 4096:9:3e-5 \
        --stop-at 0.9 --checkpoint-cache /tmp/tracin-ckpt --out benchmarks/results/tracin_recipes_H200.md
    python benchmarks/tracin_training_recipes.py --quick --recipes 64:3:5e-4   # tiny model on the CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tracin_bench import (
    FLIP_FRACTION,
    SIZES,
    Size,
    bert_adapter,
    checkpoint_accuracy,
    chosen_device,
    dataset,
    environment,
    trained_checkpoints,
)
from tracin_projected_bench import HELD_OUT, HELD_OUT_SEED, PLANS

from gpuopt_tui.core.atomic import atomic_write_text

FIT_ACCURACY_ROWS = 512  # rows of the training subset the training accuracy is measured on


def recipe(text: str) -> tuple[int, int, float]:
    try:
        fit, epochs, lr = text.split(":")
        return int(fit), int(epochs), float(lr)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FIT:EPOCHS:LR, e.g. 20480:3:1e-4, got {text!r}") from None


def train_one(size: Size, n_train: int, device: torch.device, folder: Path, cache: Path | None) -> dict[str, Any]:
    """Train the benchmark's model under `size`'s recipe; its accuracies at every checkpoint."""
    adapter = bert_adapter("bert-bench", size, device)
    train = dataset(size, n_train, 2, adapter, FLIP_FRACTION)
    fit = train.head(size.n_fit)
    checkpoints, training = trained_checkpoints(adapter, fit, size, folder, cache)
    held_out = dataset(size, HELD_OUT, HELD_OUT_SEED, adapter, 0.0)
    fit_rows = fit.head(FIT_ACCURACY_ROWS)
    return {
        "fit": len(fit),
        "epochs": size.train_epochs,
        "lr": size.train_lr,
        "seconds": training["seconds"],
        "reused": training["reused_from"] is not None,
        "fit_accuracy": checkpoint_accuracy(adapter, checkpoints, fit_rows),
        "held_out_accuracy": checkpoint_accuracy(adapter, checkpoints, held_out),
    }


def markdown(env: dict[str, Any], size_name: str, size: Size, results: list[dict[str, Any]]) -> str:
    lines = [
        "# TracIn benchmark model: training recipes",
        "",
        f"- date: {env['date']}",
        f"- device: {env['device']}",
        f"- versions: python {env['python']}, torch {env['torch']}, transformers {env['transformers']}",
        f"- command: `{env['command']}`",
        f"- model: BERT ({size_name}) hidden {size.hidden}, {size.layers} layers, vocab {size.vocab}, seq {size.seq}; "
        "AdamW with a warm-up over a tenth of the steps then linear decay to a tenth, gradient norm clipped at 1, "
        "batches of 64, fp32; checkpoints after a third, two thirds and all of the epochs",
        f"- accuracy: on the first {FIT_ACCURACY_ROWS} rows it was trained on (5% of all training labels flipped) "
        f"and on {HELD_OUT} held-out clean rows, at each checkpoint",
        "",
        "| trained on | epochs | peak lr | steps | seconds | accuracy on trained rows | held-out accuracy |",
        "|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        steps = r["epochs"] * -(-r["fit"] // 64)
        seconds = f"{r['seconds']:.1f}" + (" (cached)" if r["reused"] else "")
        fit_acc = ", ".join(f"{a:.3f}" for a in r["fit_accuracy"])
        held = ", ".join(f"{a:.3f}" for a in r["held_out_accuracy"])
        lines.append(f"| {r['fit']} | {r['epochs']} | {r['lr']:g} | {steps} | {seconds} | {fit_acc} | {held} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU (checks the script)")
    parser.add_argument("--model", choices=("small", "base"), default="base")
    parser.add_argument("--recipes", type=recipe, nargs="+", required=True, help="FIT:EPOCHS:LR, tried in order")
    parser.add_argument("--stop-at", type=float, help="stop at the first recipe reaching this held-out accuracy")
    parser.add_argument("--checkpoint-cache", type=Path, help="keep the trained checkpoints here (tracin_bench's key)")
    parser.add_argument("--out", type=Path, help="write a markdown results file here")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when there is one)")
    args = parser.parse_args(argv)
    size_name = "quick" if args.quick else args.model
    device = chosen_device(args)
    n_train = PLANS[size_name].n_train
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for fit, epochs, lr in args.recipes:
            size = dataclasses.replace(SIZES[size_name], n_fit=fit, train_epochs=epochs, train_lr=lr)
            began = time.perf_counter()
            result = train_one(size, max(n_train, fit), device, Path(tmp), args.checkpoint_cache)
            results.append(result)
            print(
                f"{fit}:{epochs}:{lr:g}: held-out accuracy {result['held_out_accuracy']} "
                f"({time.perf_counter() - began:.0f} s)",
                flush=True,
            )
            if args.stop_at is not None and result["held_out_accuracy"][-1] >= args.stop_at:
                print(f"chosen: --train-fit {fit} --train-epochs {epochs} --train-lr {lr:g}", flush=True)
                break
    text = markdown(environment(device), size_name, SIZES[size_name], results)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
