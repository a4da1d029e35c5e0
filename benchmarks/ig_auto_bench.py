"""Integrated Gradients to a tolerance (n_steps = "auto") against fixed step counts and Captum, on a BERT-base
classifier fine-tuned briefly on a synthetic task with signal.

The model: BERT-base from a BertConfig (random init), fine-tuned to tell texts with planted "positive" words
from texts with planted "negative" ones (1 to 3 of them among random filler words: they alone decide the label),
with AdamW (lr 1e-4, linear warmup over a tenth of --train-steps, then decay) until the held-out accuracy
reaches --target-accuracy or --train-seconds are spent, so that the paths from baseline to input are those of
a model that has learned something. Below --min-accuracy (0.9) the script reports nothing: a model at chance
has attributions near 0, and relative errors of rounding noise. The texts: variable length (14 to 126 words by
default), attributed the way `gpuopt-tui run` does (jobs/attribution/engine.py): sorted by length, batches
trimmed to their longest text, the lean forward, the steps on an fp16 copy of the weights (the profile
default; with auto steps, the samples whose output moves too little for fp16 to reach the tolerance run in TF32,
the profile default full_precision_fallback), F(x) and F(baseline) in fp32, [PAD] baseline keeping [CLS]/[SEP],
target = the fp32 prediction.

Rows: fixed 2000 steps (gausslegendre, the seed job's setting) in strict fp32 as the reference, on
--reference-samples texts spread evenly over the lengths (every row starts with the same texts); the same
2000 steps in the engine's fp16 (what the precision alone costs); auto at each tolerance; fixed 50 and 200
steps; Captum's LayerIntegratedGradients written the usual way (bf16 autocast around the forward,
internal_batch_size = 8 x steps, batches of 8 texts padded per batch, the same [PAD] baseline ids keeping
[CLS]/[SEP] and the same fp32-predicted target), on --captum-samples of those texts. Every row's error is
measured against the fp32 reference on its texts: per sample max |a - b| / max |b| of the token scores (as
ig_bench.py), median and max over samples. Rates of rows run on fewer texts than the whole set are
extrapolated from those texts (the table says on how many).

    python benchmarks/ig_auto_bench.py --out benchmarks/results/ig_auto_h100.md   # GPU, ~6 min on an H100
    python benchmarks/ig_auto_bench.py --quick                                   # tiny model on the CPU

With --export DIR the script stops after the fine-tune: it saves the model and its tokenizer (DIR/model) and the
texts with their labels (DIR/texts.jsonl), so that `gpuopt-tui run` can attribute the same model and texts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import Tensor
from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ig_bench import _version, device_name, sync
from gpuopt_tui.core.profiles.attribution import AttributionSection
from gpuopt_tui.jobs.attribution.adaptive import precision_floor, tolerance_warning
from gpuopt_tui.jobs.attribution.check import relative_difference
from gpuopt_tui.jobs.attribution.engine import Settings, attribute_batch
from gpuopt_tui.jobs.attribution.panels import MIN_STEPS, NEW_POINTS
from gpuopt_tui.jobs.models.hf import SequenceClassifierAdapter

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SIGNAL = 8  # planted words of each class
FULL_SET = 40_000  # the seed job's sample count, for the extrapolated times


# --- the model and the texts -----------------------------------------------------------------------------------
def vocabulary(size: int) -> list[str]:
    return (
        SPECIAL
        + [f"pos{i}" for i in range(SIGNAL)]
        + [f"neg{i}" for i in range(SIGNAL)]
        + [f"w{i}" for i in range(size - len(SPECIAL) - 2 * SIGNAL)]
    )


def planted_ids(n: int, low: int, high: int, filler: int, gen: torch.Generator) -> tuple[list[list[int]], Tensor]:
    """Word ids of `n` texts of low..high words: random filler with 1 to 3 planted words of the label's class
    (the label is decided by them alone: positive words for 1, negative ones for 0)."""
    first_filler = len(SPECIAL) + 2 * SIGNAL
    texts, labels = [], torch.randint(0, 2, (n,), generator=gen)
    for label in labels.tolist():
        length = int(torch.randint(low, high + 1, (1,), generator=gen))
        words = (first_filler + torch.randint(0, filler, (length,), generator=gen)).tolist()
        for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
            planted = len(SPECIAL) + (0 if label else SIGNAL) + int(torch.randint(0, SIGNAL, (1,), generator=gen))
            words[int(torch.randint(0, length, (1,), generator=gen))] = planted
        texts.append(words)
    return texts, labels


def make_texts(n: int, low: int, high: int, filler: int, gen: torch.Generator) -> tuple[list[str], Tensor]:
    """The texts of `planted_ids` as words (what the attribution runs tokenize)."""
    vocab = vocabulary(len(SPECIAL) + 2 * SIGNAL + filler)
    ids, labels = planted_ids(n, low, high, filler, gen)
    return [" ".join(vocab[i] for i in words) for words in ids], labels


def id_batch(ids: list[list[int]], max_length: int, device: torch.device) -> dict[str, Tensor]:
    """[CLS] words [SEP], padded: what the tokenizer makes of the texts (the vocabulary is one id per word),
    without its cost in the training loop."""
    rows = [[SPECIAL.index("[CLS]"), *words[: max_length - 2], SPECIAL.index("[SEP]")] for words in ids]
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), SPECIAL.index("[PAD]"), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row)
    return {"input_ids": input_ids.to(device), "attention_mask": (input_ids != 0).long().to(device)}


def build(args: argparse.Namespace, device: torch.device) -> SequenceClassifierAdapter:
    torch.manual_seed(0)
    vocab = vocabulary(args.vocab)
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
    if args.quick:
        config = BertConfig(
            vocab_size=len(vocab),
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=512,
            max_position_embeddings=args.max_length,
        )
    else:
        config = BertConfig(vocab_size=len(vocab))  # BERT-base otherwise: 12 layers, hidden 768
    config.num_labels = 2
    config._attn_implementation = "sdpa"
    model = BertForSequenceClassification(config).to(device)
    return SequenceClassifierAdapter("bert-base (fine-tuned on planted words)", model, tokenizer, 2, device)


def fine_tune(adapter: SequenceClassifierAdapter, args: argparse.Namespace) -> dict[str, float]:
    """AdamW with a linear warmup and decay over `args.train_steps` steps on fresh synthetic texts, stopped
    early once the held-out accuracy (checked every `args.eval_every` steps) reaches `args.target_accuracy`,
    or when `args.train_seconds` are spent. Returns the steps, seconds, final loss and held-out accuracy."""
    model, device = adapter.model, adapter.device
    gen = torch.Generator().manual_seed(1)
    filler = args.vocab - len(SPECIAL) - 2 * SIGNAL
    held, held_labels = planted_ids(512, args.min_words, args.max_words, filler, gen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.train_steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.0, (args.train_steps - s) / (args.train_steps - warmup)))
    )
    amp = torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")
    # deterministic kernels, so that runs on the same card and software fine-tune the same model (the paths, and so
    # the steps auto needs, differ a lot between fine-tunes); CUBLAS_WORKSPACE_CONFIG is set before CUDA starts
    torch.use_deterministic_algorithms(True, warn_only=True)
    start, step, accuracy, loss = time.perf_counter(), 0, 0.0, torch.zeros(())
    while step < args.train_steps:
        model.train()
        ids, labels = planted_ids(args.train_batch, args.min_words, args.max_words, filler, gen)
        loss = train_step(model, optimizer, amp, id_batch(ids, args.max_length, device), labels.to(device))
        schedule.step()
        step += 1
        if step % args.eval_every and step < args.train_steps:
            continue
        accuracy = held_out_accuracy(adapter, held, held_labels, args.max_length)
        seconds = time.perf_counter() - start
        print(
            f"  step {step}: loss {float(loss.detach()):.3f}, held-out accuracy {accuracy:.3f} ({seconds:.0f} s)",
            flush=True,
        )
        if accuracy >= args.target_accuracy or seconds > args.train_seconds:
            break
    torch.use_deterministic_algorithms(False)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return {
        "steps": step,
        "accuracy": accuracy,
        "seconds": time.perf_counter() - start,
        "final_loss": float(loss.detach()),
    }


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, amp: Any, batch: dict[str, Tensor], labels: Tensor
) -> Tensor:
    """One optimizer step (gradients clipped to norm 1) on `batch`; its loss."""
    with amp:
        loss = model(**batch, labels=labels).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss


def held_out_accuracy(
    adapter: SequenceClassifierAdapter, ids: list[list[int]], labels: Tensor, max_length: int
) -> float:
    adapter.model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(ids), 128):
            logits = adapter.model(**id_batch(ids[i : i + 128], max_length, adapter.device)).logits
            correct += int((logits.argmax(-1).cpu() == labels[i : i + 128]).sum())
    return correct / len(ids)


# --- the rows ----------------------------------------------------------------------------------------------------
@dataclass
class Row:
    name: str
    samples: int
    seconds: float
    scores: Tensor = field(repr=False)  # [samples, S] token scores (the rows of the reference texts first)
    steps: Tensor = field(repr=False)  # [samples] steps each sample used
    captum: bool = False
    full: Tensor | None = field(default=None, repr=False)  # [samples] bool: its steps ran in full precision

    @property
    def rate(self) -> float:
        return self.samples / self.seconds


def engine_row(
    name: str, adapter: SequenceClassifierAdapter, texts: list[str], args: argparse.Namespace, **attribution: Any
) -> Row:
    """The engine over `texts` (already in length order), `batch_size` (default `args.batch`) at a time, as the
    job runs it."""
    batch = attribution.pop("batch_size", args.batch)
    section = AttributionSection(batch_size=batch, compile="off", **attribution)
    settings = Settings.resolve(section, adapter, adapter.device, len(texts))
    print(f"  {name}: {len(texts)} texts, {settings.ig.precision} steps ...", flush=True)
    if section.n_steps == "auto" and (
        warning := tolerance_warning(section.tolerance, settings.ig.precision, settings.ig.full_precision_fallback)
    ):
        print(f"    note: {warning}", flush=True)
    planner = settings.planner()
    scores = torch.zeros(len(texts), args.max_length)
    steps = torch.zeros(len(texts), dtype=torch.long)
    full = torch.zeros(len(texts), dtype=torch.bool)
    warm = adapter.tokenize(texts[:batch], args.max_length)
    attribute_batch(adapter, {k: v.to(adapter.device) for k, v in warm.items()}, settings, planner)
    sync(adapter.device)
    start = time.perf_counter()
    for i in range(0, len(texts), batch):
        inputs = {k: v.to(adapter.device) for k, v in adapter.tokenize(texts[i : i + batch], args.max_length).items()}
        out = attribute_batch(adapter, inputs, settings, planner)
        rows = slice(i, i + out["token_scores"].shape[0])
        scores[rows, : out["token_scores"].shape[1]] = out["token_scores"]
        steps[rows] = out["steps"]
        full[rows] = out["fallback"] > 0
    sync(adapter.device)
    row = Row(name, len(texts), time.perf_counter() - start, scores, steps, full=full)
    print(f"    {row.rate:9.2f} samples/s, {int(steps.sum()):,} sample-steps in {row.seconds:.0f} s", flush=True)
    return row


def captum_row(adapter: SequenceClassifierAdapter, texts: list[str], targets: Tensor, steps: int, args) -> Row:
    """Captum's LayerIntegratedGradients as its users write it (see the module docstring)."""
    from captum.attr import LayerIntegratedGradients

    model, device, tok = adapter.model, adapter.device, adapter.tokenizer
    bf16 = device.type == "cuda"

    def forward(ids: Tensor, mask: Tensor) -> Tensor:
        with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
            return model(input_ids=ids, attention_mask=mask).logits.float()

    lig = LayerIntegratedGradients(forward, model.bert.embeddings.word_embeddings)
    scores = torch.zeros(len(texts), args.max_length)

    def run(rows: range) -> None:
        for i in range(rows.start, rows.stop, 8):
            enc = tok(texts[i : min(i + 8, rows.stop)], padding=True, truncation=True, max_length=args.max_length,
                      return_tensors="pt").to(device)  # fmt: skip
            ids, mask = enc["input_ids"], enc["attention_mask"]
            keep = (ids == tok.cls_token_id) | (ids == tok.sep_token_id) | (mask == 0)
            reference = torch.where(keep, ids, tok.pad_token_id)
            attributions = lig.attribute(
                ids,
                reference,
                target=targets[i : i + ids.shape[0]].to(device),
                additional_forward_args=(mask,),
                n_steps=steps,
                internal_batch_size=8 * steps,
            )
            scores[i : i + ids.shape[0], : ids.shape[1]] = attributions.sum(-1).float().cpu()

    print(f"  Captum LIG: {len(texts)} texts, bf16 autocast, {steps} steps ...", flush=True)
    run(range(0, min(8, len(texts))))  # warm-up
    sync(device)
    start = time.perf_counter()
    run(range(0, len(texts)))
    sync(device)
    row = Row(f"Captum LIG, bf16 autocast, {steps} steps", len(texts), time.perf_counter() - start, scores,
              torch.full((len(texts),), steps), captum=True)  # fmt: skip
    print(f"    {row.rate:9.2f} samples/s in {row.seconds:.0f} s", flush=True)
    return row


# --- the report --------------------------------------------------------------------------------------------------
def entry(row: Row, reference: Row, full_rate: float, cap: int) -> dict[str, Any]:
    n = reference.samples
    error = relative_difference(row.scores[:n], reference.scores)
    below_cap = error[row.steps[:n] < cap]  # samples auto stopped as converged (capped ones are warned about)
    histogram = sorted(Counter(row.steps.tolist()).items())
    return {
        "method": row.name,
        "samples": row.samples,
        "samples_per_s": row.rate,
        "sample_steps": int(row.steps.sum()),
        "mean_steps": float(row.steps.double().mean()),
        "rel_err_median": float(error.median()),
        "rel_err_max": float(error.max()),
        "rel_err_max_below_cap": float(below_cap.max()) if len(below_cap) else None,
        "capped": int((row.steps >= cap).sum()) if row.name.startswith("auto") else 0,
        "full_precision": 0 if row.full is None else int(row.full.sum()),
        "rel_err_max_full": _group_max(error, row.full, True),
        "rel_err_max_low": _group_max(error, row.full, False),
        "steps_histogram": histogram,
        "minutes_for_40k": FULL_SET / row.rate / 60,
        "speedup_vs_reference": row.rate / full_rate,
        "captum": row.captum,
    }


def _group_max(error: Tensor, full: Tensor | None, in_full: bool) -> float | None:
    """The largest error among the reference texts whose steps ran in full precision (`in_full`) or not."""
    if full is None:
        return None
    chosen = error[full[: len(error)] == in_full]
    return float(chosen.max()) if len(chosen) else None


def _sci(value: float | None) -> str:
    return "none" if value is None else f"{value:.1e}"


def histogram_text(histogram: list[tuple[int, int]]) -> str:
    return " · ".join(f"{steps}: {count}" for steps, count in histogram)


def render(meta: dict[str, Any], entries: list[dict[str, Any]]) -> str:
    lines = [
        "# Integrated Gradients to a tolerance (n_steps = auto)",
        "",
        f"- date: {meta['date']}",
        f"- device: {meta['device']}",
        f"- torch {meta['torch']}, transformers {meta['transformers']}, captum {meta['captum'] or 'not run'}",
        f"- command: `{meta['command']}`",
        f"- model: {meta['model']}, fine-tuned {meta['train']['steps']} steps of {meta['train']['batch']} texts in "
        f"{meta['train']['seconds']:.0f} s (AdamW, lr {meta['train']['lr']:g}, linear warmup and decay); held-out "
        f"accuracy {meta['train']['accuracy']:.3f}",
        f"- texts: {meta['samples']} of {meta['min_words']}..{meta['max_words']} words (mean {meta['mean_tokens']:.0f} "
        f"tokens), batches of {meta['batch']} in length order; ours: {meta['precision']} steps, F(x) and F(baseline) "
        "in fp32, [PAD] baseline keeping [CLS]/[SEP]",
        f"- reference: fixed {meta['reference_steps']} steps (gausslegendre) in strict fp32 (no TF32) on "
        f"{meta['reference_samples']} texts spread over the lengths; rel. error (every row, on those texts): per "
        "sample max |a - b| / max |b| of the token scores against it, median / max; x reference: samples/s over "
        "the reference's",
        f"- auto: adaptive Simpson panels ({MIN_STEPS} points, then {NEW_POINTS} more per pass where the error "
        "estimate is largest) "
        "until the convergence delta and the token scores' error estimate are within the tolerance (raised to the "
        f"steps' precision floor, {meta['floor']:.0e}; absolute parts: that floor x |F(x)| for the delta, x the "
        f"integral of |g_t| for token t's estimate); cap {meta['max_steps']} steps",
        f"- min for 40k: {FULL_SET:,} / samples/s (the seed job's sample count), extrapolated",
        "",
        "| method | texts | samples/s | sample-steps | mean steps | rel. error (median / max) | x reference | "
        "min for 40k |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in entries:
        lines.append(
            f"| {e['method']} | {e['samples']} | {e['samples_per_s']:.1f} | {e['sample_steps']:,} | "
            f"{e['mean_steps']:.1f} | {e['rel_err_median']:.1e} / {e['rel_err_max']:.1e} | "
            f"{e['speedup_vs_reference']:.1f} | {e['minutes_for_40k']:.1f} |"
        )
    lines += ["", "Steps per sample (steps: samples):", ""]
    lines += [
        f"- {e['method']}: {histogram_text(e['steps_histogram'])}; {e['capped']} at the cap; rel. error max of the "
        f"reference texts it stopped below the cap: {_sci(e['rel_err_max_below_cap'])}; "
        f"{e['full_precision']} samples in full precision (rel. error max of the reference texts among them: "
        f"{_sci(e['rel_err_max_full'])}; of the others: {_sci(e['rel_err_max_low'])})"
        for e in entries
        if e["method"].startswith("auto")
    ]
    lines += ["", "Goals:", "", *goals(entries), ""]
    return "\n".join(lines)


VARIANTS = {  # step precisions besides the default (fp16 on a copy of the weights, full-precision fallback on)
    "fp16, no fallback": {"full_precision_fallback": False},
    "fp16 autocast": {"amp_mode": "autocast"},
    "bf16 autocast": {"amp_mode": "autocast", "amp_dtype": "bf16"},
    "tf32": {"use_amp": False, "tf32": True},
}
ERROR_GOAL, SPEEDUP_GOAL, MINUTES_GOAL, CAPTUM_GOAL = 1e-2, 10.0, 10.0, 10.0


def goals(entries: list[dict[str, Any]]) -> list[str]:
    """entries[0] is the fp32 reference, entries[1] the same steps in the engine's precision."""
    ours = [e for e in entries if not e["captum"] and e is not entries[0]]
    within = [e for e in ours if e["rel_err_max"] <= ERROR_GOAL]
    if not within:
        return [f"- no row of ours is within {ERROR_GOAL:.0e} (max) of the reference"]
    best = max(within, key=lambda e: e["samples_per_s"])
    lines = [
        f"- fastest of ours within {ERROR_GOAL:.0e} (max) of the reference: {best['method']}, "
        f"{best['speedup_vs_reference']:.1f}x the reference's rate (goal {SPEEDUP_GOAL:.0f}x: "
        f"{'met' if best['speedup_vs_reference'] >= SPEEDUP_GOAL else 'not met'}); 40k samples in "
        f"{best['minutes_for_40k']:.1f} min (goal {MINUTES_GOAL:.0f}: "
        f"{'met' if best['minutes_for_40k'] <= MINUTES_GOAL else 'not met'}); "
        f"{best['samples_per_s'] / entries[1]['samples_per_s']:.1f}x the rate of {entries[1]['method']}"
    ]
    for captum in (e for e in entries if e["captum"]):
        ratio = best["samples_per_s"] / captum["samples_per_s"]
        lines.append(
            f"- against {captum['method']} (rel. error max {captum['rel_err_max']:.1e}): {ratio:.1f}x "
            f"(goal {CAPTUM_GOAL:.0f}x: {'met' if ratio >= CAPTUM_GOAL else 'not met'})"
        )
        # the same comparison at Captum's own accuracy: our fastest row at least as close to the reference
        as_close = [e for e in ours if e["rel_err_max"] <= captum["rel_err_max"]]
        if as_close and (fast := max(as_close, key=lambda e: e["samples_per_s"])) is not best:
            ratio = fast["samples_per_s"] / captum["samples_per_s"]
            lines.append(
                f"- at least as close to the reference as {captum['method']}: {fast['method']} "
                f"(rel. error max {fast['rel_err_max']:.1e}), {ratio:.1f}x "
                f"(goal {CAPTUM_GOAL:.0f}x: {'met' if ratio >= CAPTUM_GOAL else 'not met'})"
            )
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU: checks the script")
    parser.add_argument("--out", type=Path, help="write a markdown results file here (and a .json next to it)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--min-words", type=int, default=14)
    parser.add_argument("--max-words", type=int, default=126)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--train-steps", type=int, default=1500, help="most fine-tuning steps (the schedule's length)")
    parser.add_argument("--train-batch", type=int, default=32)
    parser.add_argument("--train-seconds", type=float, default=90, help="fine-tuning stops after about this long")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between held-out accuracy checks")
    parser.add_argument("--target-accuracy", type=float, default=0.99, help="fine-tuning stops once reached")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--min-accuracy", type=float, default=0.9, help="report nothing below this accuracy")
    parser.add_argument("--reference-steps", type=int, default=2000)
    parser.add_argument("--reference-samples", type=int, default=128, help="texts of the fp32 reference")
    parser.add_argument("--fixed-steps", type=int, nargs="*", default=[50, 200])
    parser.add_argument("--tolerances", type=float, nargs="+", default=[1e-2, 1e-3])
    parser.add_argument("--max-steps", type=int, default=513, help="cap of the auto rows")
    parser.add_argument(
        "--variants", nargs="*", default=[], choices=list(VARIANTS), help="other step precisions to run as well"
    )
    parser.add_argument(
        "--skip-variant-fixed", action="store_true", help="no fixed reference-steps row for the --variants"
    )
    parser.add_argument("--dump", type=Path, help="save every row's token scores and steps here (torch.save)")
    parser.add_argument("--auto-batches", type=int, nargs="*", default=[], help="auto rows at these batch sizes too")
    parser.add_argument("--captum-steps", type=int, default=50)
    parser.add_argument("--captum-samples", type=int, default=128)
    parser.add_argument("--skip-captum", action="store_true")
    parser.add_argument("--export", type=Path, help="save the fine-tuned model and the texts here, then stop")
    args = parser.parse_args(argv)
    if args.quick:
        args.samples, args.min_words, args.max_words, args.max_length = 32, 3, 20, 32
        args.batch, args.vocab, args.train_steps, args.train_seconds = 8, 2048, 600, 120
        args.reference_steps, args.reference_samples, args.fixed_steps = 100, 8, [8, 16]
        args.max_steps, args.captum_steps, args.captum_samples = 65, 8, 8
        args.device = "cpu" if args.device == "auto" else args.device
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the fine-tune
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    adapter = build(args, device)
    print(
        f"{device_name(device)}: fine-tuning (at most {args.train_steps} steps, ~{args.train_seconds:.0f} s)",
        flush=True,
    )
    train = fine_tune(adapter, args)
    print(
        f"  held-out accuracy {train['accuracy']:.3f} after {train['steps']} steps, {train['seconds']:.0f} s",
        flush=True,
    )
    if train["accuracy"] < args.min_accuracy:
        print(
            f"error: the model did not learn the task (held-out accuracy {train['accuracy']:.3f} < "
            f"{args.min_accuracy}): its attributions would be rounding noise, so nothing is reported; "
            "raise --train-steps/--train-seconds or change --lr",
            file=sys.stderr,
        )
        return 1

    gen = torch.Generator().manual_seed(2)
    filler = args.vocab - len(SPECIAL) - 2 * SIGNAL
    texts, labels = make_texts(args.samples, args.min_words, args.max_words, filler, gen)
    if args.export:
        export(adapter, texts, labels, args.export)
        return 0
    lengths = [len(adapter.tokenizer.tokenize(t)) + 2 for t in texts]
    texts = [texts[i] for i in sorted(range(len(texts)), key=lambda i: -lengths[i])]  # length order, as the job
    # the reference texts: evenly spread over the length-ordered set, so that they span the lengths
    stride = max(1, len(texts) // args.reference_samples)
    subset = texts[::stride][: args.reference_samples]
    texts = subset + [t for i, t in enumerate(texts) if i % stride or i // stride >= len(subset)]
    subset_texts = texts[: len(subset)]

    reference = engine_row(
        f"fixed {args.reference_steps} steps, fp32 (reference)",
        adapter,
        subset_texts,
        args,
        n_steps=args.reference_steps,
        use_amp=False,
        tf32=False,
    )
    rows = [
        reference,
        engine_row(f"fixed {args.reference_steps} steps", adapter, subset_texts, args, n_steps=args.reference_steps),
    ]
    for tolerance in args.tolerances:
        rows.append(
            engine_row(
                f"auto, tolerance {tolerance:g}",
                adapter,
                texts,
                args,
                n_steps="auto",
                tolerance=tolerance,
                max_steps=args.max_steps,
            )
        )
    for batch in args.auto_batches:  # the auto rule at other batch sizes: more samples per refinement pass
        for tolerance in args.tolerances:
            rows.append(
                engine_row(f"auto, tolerance {tolerance:g}, batches of {batch}", adapter, texts, args, n_steps="auto",
                           tolerance=tolerance, max_steps=args.max_steps, batch_size=batch)
            )  # fmt: skip
    for steps in args.fixed_steps:
        rows.append(engine_row(f"fixed {steps} steps", adapter, texts, args, n_steps=steps))
    for name in args.variants:  # other step precisions: what each costs alone (2000 steps) and auto at each tolerance
        precision = VARIANTS[name]
        if not args.skip_variant_fixed:
            rows.append(
                engine_row(f"fixed {args.reference_steps} steps, {name}", adapter, subset_texts, args,
                           n_steps=args.reference_steps, **precision)
            )  # fmt: skip
        for tolerance in args.tolerances:
            rows.append(
                engine_row(f"auto, tolerance {tolerance:g}, {name}", adapter, texts, args, n_steps="auto",
                           tolerance=tolerance, max_steps=args.max_steps, **precision)
            )  # fmt: skip
    captum_version = None if args.skip_captum else _version("captum")
    if captum_version:
        targets = torch.cat(
            [attribute_targets(adapter, subset_texts[i : i + 64], args) for i in range(0, len(subset), 64)]
        )
        captum_texts = subset_texts[: args.captum_samples]
        rows.append(captum_row(adapter, captum_texts, targets, args.captum_steps, args))
    elif not args.skip_captum:
        print("captum is not installed: its row is skipped", flush=True)

    entries = [entry(row, reference, reference.rate, args.max_steps) for row in rows]
    meta = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": device_name(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "captum": captum_version,
        "command": "python " + shlex.join(sys.argv),
        "model": "BERT-base" if not args.quick else "tiny BERT (quick check)",
        "train": {"lr": args.lr, "batch": args.train_batch, **train},
        "samples": args.samples,
        "min_words": args.min_words,
        "max_words": args.max_words,
        "mean_tokens": sum(lengths) / len(lengths),
        "batch": args.batch,
        "precision": "fp16 weights (auto: the samples fp16 cannot resolve to the tolerance in TF32, the "
        "full_precision_fallback setting, unless the row says no fallback)"
        if device.type == "cuda"
        else "fp32",
        "floor": precision_floor("fp16" if device.type == "cuda" else "fp32"),
        "reference_steps": args.reference_steps,
        "reference_samples": len(subset),
        "max_steps": args.max_steps,
    }
    report = render(meta, entries)
    print("\n" + report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report, encoding="utf-8")
        args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": entries}, indent=1), "utf-8")
        print(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    if args.dump:
        torch.save({row.name: {"scores": row.scores, "steps": row.steps} for row in rows}, args.dump)
    return 0


def export(adapter: SequenceClassifierAdapter, texts: list[str], labels: Tensor, folder: Path) -> None:
    """The fine-tuned model with its tokenizer (folder/model) and the texts (folder/texts.jsonl: text, label)."""
    adapter.model.save_pretrained(folder / "model")
    adapter.tokenizer.save_pretrained(folder / "model")
    lines = (json.dumps({"text": text, "label": int(label)}) for text, label in zip(texts, labels.tolist()))
    (folder / "texts.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {folder / 'model'} and {folder / 'texts.jsonl'} ({len(texts)} texts)")


def attribute_targets(adapter: SequenceClassifierAdapter, texts: list[str], args: argparse.Namespace) -> Tensor:
    """The fp32 prediction of each text: the class every row explains."""
    batch = {k: v.to(adapter.device) for k, v in adapter.tokenize(texts, args.max_length).items()}
    with torch.no_grad():
        return adapter.model(**batch).logits.argmax(-1).cpu()


if __name__ == "__main__":
    raise SystemExit(main())
