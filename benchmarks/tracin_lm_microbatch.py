"""TracIn's training gradients of a Llama with LoRA adapters: seconds per micro-batch, and where they go.

A decoder (a small Llama: --layers layers, hidden --hidden, vocabulary --vocab; or --shape, a public checkpoint's
shapes from lm_attribution.py; random weights, in --base-dtype, on --device) gets a LoRA
adapter (r = --rank on every Linear layer, peft; B initialised at random so that every gradient is non-zero), and
the engine's factored projection (--projection x --projection per LoRA matrix) computes the per-example gradients of
rows of about --tokens tokens (prompt + completion, the completion an eighth of it, as tracin_lm_bench.py's rows) in
micro-batches of --batch, the way a TracIn run does (MicroBatcher: trimming, the copy to the device, the features).
Each round times --batches micro-batches; the figure is the median over --rounds rounds (after one warm-up
micro-batch), with the load average of the machine before and after. --profile prints torch.profiler's table of
one micro-batch (operators by self CPU time, or self CUDA time on a GPU) and the number of operators it ran.
--plain also times a plain LoRA training step of the same micro-batches (the summed loss's backward to the adapter
weights, no per-example work): the floor a per-example method is measured against. --sub-layers also times the
factored projection with hooks on each LoRA layer's lora_A and lora_B sub-layers under PEFT's own forward (the
engine before jobs/tracin/lora_layers.py), on the same model and rows.

Run it against two checkouts to compare them (PYTHONPATH picks the engine):

    PYTHONPATH=. python benchmarks/tracin_lm_microbatch.py --rounds 5
    PYTHONPATH=. python benchmarks/tracin_lm_microbatch.py --profile
    python benchmarks/tracin_lm_microbatch.py --shape llama-1b --device cuda --base-dtype bfloat16 \
        --precision bf16 --rank 128 --batch 32 --plain
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

from benchmarks.lm_attribution import SHAPES, SPECIAL, build_model, dataset, word_tokenizer
from benchmarks.tracin_lm_bench import make_rows
from gpuopt_tui.jobs.device import autocast
from gpuopt_tui.jobs.models.causal_lm import CausalLMAdapter
from gpuopt_tui.jobs.tracin.grads import GradientComputer
from gpuopt_tui.jobs.tracin.interface import Reporter
from gpuopt_tui.jobs.tracin.microbatch import MicroBatcher, to_device, trim_batch


def build(args: argparse.Namespace) -> tuple[GradientComputer, object, list[int]]:
    import peft
    import transformers

    device = torch.device(args.device)
    if args.shape:
        model = build_model(args.shape, device).to(getattr(torch, args.base_dtype))
        vocab = SHAPES[args.shape]["vocab_size"]
    else:
        config = transformers.LlamaConfig(
            hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=args.vocab, max_position_embeddings=2048,
            tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=3,
        )  # fmt: skip
        torch.manual_seed(0)
        with device:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.base_dtype))
        model = model.eval().requires_grad_(False)
        vocab = args.vocab
    lora = peft.LoraConfig(
        r=args.rank, lora_alpha=args.rank, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False
    )
    model = peft.get_peft_model(model, lora).to(device).eval()  # adapter weights in fp32, as a run loads them
    n_words = min(30000, vocab - len(SPECIAL))
    tokenizer = word_tokenizer(n_words)
    adapter = CausalLMAdapter("bench", model, tokenizer, device)
    computer = make_computer(adapter, args)
    rows_args = argparse.Namespace(tasks=8, tokens=args.tokens)
    rows = make_rows(args.batch * (args.batches + 1), rows_args, n_words, seed=1, flipped=0.0)
    ds = dataset(adapter, [r["prompt"] for r in rows], [r["completion"] for r in rows])
    return computer, ds, list(range(len(rows)))


def make_computer(adapter: CausalLMAdapter, args: argparse.Namespace) -> GradientComputer:
    names = [n for n, p in adapter.model.named_parameters() if p.requires_grad]
    return GradientComputer(
        adapter, names, method="factored", precision=args.precision, factored_sizes=(args.projection,) * 2
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_round(computer: GradientComputer, ds: object, rows: list[int], batch: int) -> float:
    """Seconds per micro-batch over the rows after the first micro-batch (a warm-up)."""
    device = computer.adapter.device
    batcher = MicroBatcher(batch, Reporter())
    runs = batcher.run(computer, ds, rows, "train")
    next(runs)
    _sync(device)
    start = time.perf_counter()
    count = 0
    for _, feats in runs:
        feats.dense.sum().item()  # waits for the micro-batch, as the run's scoring does
        count += 1
    return (time.perf_counter() - start) / count


def plain_round(computer: GradientComputer, ds: object, rows: list[int], batch: int) -> float:
    """Seconds per micro-batch of a plain LoRA training step on the same rows (summed loss, backward to the adapter
    weights): the cost of one batched forward and backward, without per-example gradients."""
    adapter = computer.adapter
    params = [p for p in adapter.model.parameters() if p.requires_grad]
    chunks = [rows[k : k + batch] for k in range(0, len(rows), batch)]
    times = []
    for chunk in chunks:
        batch_tensors = to_device(trim_batch(ds.batch(chunk), ds.token_fields), adapter.device)
        _sync(adapter.device)
        start = time.perf_counter()
        with autocast(adapter.device, computer.precision):
            loss = adapter.loss_per_example(batch_tensors).sum()
        torch.autograd.grad(loss, params)[0].sum().item()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def profile(computer: GradientComputer, ds: object, rows: list[int], batch: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    batcher = MicroBatcher(batch, Reporter())
    runs = batcher.run(computer, ds, rows[: 2 * batch], "train")
    next(runs)
    cuda = computer.adapter.device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with torch_profile(activities=activities) as prof:
        next(runs)[1].dense.sum().item()
    events = prof.key_averages()
    print(events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=40))
    print(f"operators called: {sum(e.count for e in events if e.key.startswith('aten::'))} aten calls")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), help="a public checkpoint's shapes instead of the small Llama"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--base-dtype", choices=("float32", "bfloat16"), default="float32")
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
    parser.add_argument("--plain", action="store_true", help="also time a plain LoRA training step")
    parser.add_argument("--sub-layers", action="store_true", help="also time the sub-layer hooks (see above)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    computer, ds, rows = build(args)
    if args.profile:
        profile(computer, ds, rows, args.batch)
        return
    load = os.getloadavg()[0]
    times = [one_round(computer, ds, rows, args.batch) for _ in range(args.rounds)]
    report("factored", times, args)
    if args.sub_layers:
        from gpuopt_tui.jobs.tracin import factored

        factored.lora_layers = lambda model, names: {}
        old = make_computer(computer.adapter, args)
        report("factored, sub-layer hooks", [one_round(old, ds, rows, args.batch) for _ in range(args.rounds)], args)
    if args.plain:
        report("plain LoRA step", [plain_round(computer, ds, rows, args.batch) for _ in range(args.rounds)], args)
    print(f"load {load:.2f} -> {os.getloadavg()[0]:.2f}")
    if computer.adapter.device.type == "cuda":
        print(f"peak reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB")


def report(what: str, times: list[float], args: argparse.Namespace) -> None:
    median = statistics.median(times)
    print(
        f"{what}: s per micro-batch of {args.batch} x ~{args.tokens} tokens: median {median:.3f} "
        f"(rounds: {', '.join(f'{t:.3f}' for t in times)}); {args.batch / median:.1f} examples/s"
    )


if __name__ == "__main__":
    main()
