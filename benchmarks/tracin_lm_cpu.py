"""TracIn's training gradients on a small Llama with LoRA adapters, on the CPU: seconds per micro-batch, and where
they go.

A small decoder (Llama shapes: --layers layers, hidden --hidden, vocabulary --vocab; random weights) gets a LoRA
adapter (r = --rank on every Linear layer, peft; B initialised at random so that every gradient is non-zero), and
the engine's factored projection (--projection x --projection per LoRA matrix) computes the per-example gradients of
rows of about --tokens tokens (prompt + completion, the completion an eighth of it, as tracin_lm_bench.py's rows) in
micro-batches of --batch, the way a TracIn run does (MicroBatcher: trimming, the copy to the device, the features).
Each round times --batches micro-batches; the figure is the median over --rounds rounds (after one warm-up
micro-batch), with the load average of the machine before and after. --profile prints torch.profiler's table of
one micro-batch (operators by self CPU time) and the number of operators it ran.

Run it against two checkouts to compare them (PYTHONPATH picks the engine):

    PYTHONPATH=. python benchmarks/tracin_lm_cpu.py --rounds 5
    PYTHONPATH=. python benchmarks/tracin_lm_cpu.py --profile
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lm_attribution import SPECIAL, dataset, word_tokenizer
from benchmarks.tracin_lm_bench import make_rows
from gpuopt_tui.jobs.models.causal_lm import CausalLMAdapter
from gpuopt_tui.jobs.tracin.grads import GradientComputer
from gpuopt_tui.jobs.tracin.interface import Reporter
from gpuopt_tui.jobs.tracin.microbatch import MicroBatcher


def build(args: argparse.Namespace) -> tuple[GradientComputer, object, list[int]]:
    import peft
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=args.vocab, max_position_embeddings=2048,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
    lora = peft.LoraConfig(
        r=args.rank, lora_alpha=args.rank, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False
    )
    model = peft.get_peft_model(model, lora).eval()
    n_words = args.vocab - len(SPECIAL)
    tokenizer = word_tokenizer(n_words)
    adapter = CausalLMAdapter("small", model, tokenizer, torch.device("cpu"))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    computer = GradientComputer(
        adapter, names, method="factored", precision=args.precision, factored_sizes=(args.projection,) * 2
    )
    rows_args = argparse.Namespace(tasks=8, tokens=args.tokens)
    rows = make_rows(args.batch * (args.batches + 1), rows_args, n_words, seed=1, flipped=0.0)
    ds = dataset(adapter, [r["prompt"] for r in rows], [r["completion"] for r in rows])
    return computer, ds, list(range(len(rows)))


def one_round(computer: GradientComputer, ds: object, rows: list[int], batch: int) -> float:
    """Seconds per micro-batch over the rows after the first micro-batch (a warm-up)."""
    batcher = MicroBatcher(batch, Reporter())
    runs = batcher.run(computer, ds, rows, "train")
    next(runs)
    start = time.perf_counter()
    count = sum(1 for _ in runs)
    return (time.perf_counter() - start) / count


def profile(computer: GradientComputer, ds: object, rows: list[int], batch: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    batcher = MicroBatcher(batch, Reporter())
    runs = batcher.run(computer, ds, rows[: 2 * batch], "train")
    next(runs)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        next(runs)
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=30))
    print(f"operators called: {sum(e.count for e in events if e.key.startswith('aten::'))} aten calls")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--projection", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=4, help="micro-batches timed per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    computer, ds, rows = build(args)
    if args.profile:
        profile(computer, ds, rows, args.batch)
        return
    load = os.getloadavg()[0]
    times = [one_round(computer, ds, rows, args.batch) for _ in range(args.rounds)]
    print(
        f"s per micro-batch of {args.batch} x ~{args.tokens} tokens: median {statistics.median(times):.3f} "
        f"(rounds: {', '.join(f'{t:.3f}' for t in times)}); load {load:.2f} -> {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
