"""IG to a tolerance on models the engine was never tuned on: classifiers of several families, trained here on two
tasks that make integrands sharp, checked sample by sample against strict fp32 references.

Families (from transformers configs, random init, all the same size: --layers, --hidden): BERT, RoBERTa,
DistilBERT (a ReLU in its head: the integrand jumps), ELECTRA, ALBERT, DeBERTa-v2. Tasks, over texts of 14-126
random filler words (ig_auto_bench.py's vocabulary):
- planted: 1 to 3 planted words of the label's class decide it;
- majority: 1 to 4 positive and 1 to 4 negative marker words (never as many): the label is whichever is more
  (markers weighed against each other: a saturated, attention-dependent decision).
Each model trains (AdamW, bf16 autocast) until --target-accuracy on held-out texts or --train-seconds.

On --samples held-out texts (batches of --batch in length order, the [PAD] baseline keeping [CLS]/[SEP], target =
the fp32 prediction, as `gpuopt-tui run` does):
- references: fixed 2000 Gauss-Legendre steps in strict fp32 (no TF32), and the adaptive panels to 1e-4 in strict
  fp32 (up to 8193 points): where the two differ, the integrand has kinks that 2000 fixed steps do not resolve;
- ours: n_steps = "auto" at each tolerance, with the defaults (fp16 weights, full-precision fallback) and in TF32;
- Captum LayerIntegratedGradients as users write it (bf16 autocast, 50 steps, batches of 8).
Rates (--rate-samples other texts, 0 for none): the auto rows at the loosest tolerance (defaults, TF32, fp16 without
the fallback) and Captum, on enough texts that a run's one-off costs (the start precision's measurement, the first
batch) weigh as in a long run. Several processes (one per (family, task) pair, e.g. benchmarks/gpu_session.sh
ig-conformance-split) write one .json each; --merge renders them into one file.
Error of a row, per sample: max |a - b| / max |b| of the token scores against a reference. For the auto rows the
engine's own verdict (`within`) is checked: a silent miss is a sample reported within the tolerance whose error
against the reference exceeds it. Rates are measured on the same texts after a warm-up batch.

    python benchmarks/ig_conformance.py --out benchmarks/results/ig_conformance_H100.md   # GPU
    python benchmarks/ig_conformance.py --quick                                          # the CPU: checks the script
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ig_auto_bench import SIGNAL, SPECIAL, id_batch, planted_ids, train_step, vocabulary
from benchmarks.ig_bench import _version, device_name, sync
from gpuopt_tui.core.profiles.attribution import AttributionSection
from gpuopt_tui.jobs.attribution.check import relative_difference
from gpuopt_tui.jobs.attribution.engine import Settings, attribute_batch
from gpuopt_tui.jobs.models.hf import SequenceClassifierAdapter

FAMILIES = ("bert", "roberta", "distilbert", "electra", "albert", "deberta-v2")
TASKS = ("planted", "majority")
FIRST_FILLER = len(SPECIAL) + 2 * SIGNAL
MEMORY_FRACTION = [0.9]  # of the GPU's free memory for each run's chunks (--memory-fraction: processes sharing it)
FINE_TOLERANCE = 1e-4  # the fine reference's: a tenth of the tightest tolerance measured


def config(family: str, args: argparse.Namespace) -> transformers.PretrainedConfig:
    """A `family` classifier config of the benchmark's size (2 labels, [PAD] = 0)."""
    size = {"vocab_size": args.vocab, "num_labels": 2, "pad_token_id": 0}
    layers, hidden, heads = args.layers, args.hidden, args.heads
    if family == "distilbert":
        return transformers.DistilBertConfig(
            n_layers=layers, dim=hidden, n_heads=heads, hidden_dim=4 * hidden, max_position_embeddings=512, **size
        )
    common = {
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "intermediate_size": 4 * hidden,
        "max_position_embeddings": 512,
        **size,
    }
    if family == "albert":
        return transformers.AlbertConfig(embedding_size=hidden // 2, **common)
    if family == "deberta-v2":
        return transformers.DebertaV2Config(relative_attention=True, pos_att_type=["p2c", "c2p"], **common)
    classes = {
        "bert": transformers.BertConfig,
        "roberta": transformers.RobertaConfig,
        "electra": transformers.ElectraConfig,
    }
    return classes[family](**common)


def task_ids(task: str, n: int, args: argparse.Namespace, gen: torch.Generator) -> tuple[list[list[int]], Tensor]:
    """Word ids of `n` texts of the task and their labels."""
    filler = args.vocab - FIRST_FILLER
    if task == "planted":
        return planted_ids(n, args.min_words, args.max_words, filler, gen)
    texts, labels = [], []
    for _ in range(n):
        length = int(torch.randint(args.min_words, args.max_words + 1, (1,), generator=gen))
        pos, neg = (int(v) for v in torch.randint(1, 5, (2,), generator=gen))
        while pos == neg:
            neg = int(torch.randint(1, 5, (1,), generator=gen))
        words = (FIRST_FILLER + torch.randint(0, filler, (length,), generator=gen)).tolist()
        slots = torch.randperm(length, generator=gen)[: pos + neg].tolist()
        for k, slot in enumerate(slots):
            words[slot] = len(SPECIAL) + (0 if k < pos else SIGNAL) + int(torch.randint(0, SIGNAL, (1,), generator=gen))
        texts.append(words)
        labels.append(int(pos > neg))
    return texts, torch.tensor(labels)


def train(family: str, task: str, args: argparse.Namespace, device: torch.device) -> tuple[Any, dict[str, Any]]:
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(config(family, args)).to(device)
    gen = torch.Generator().manual_seed(1)
    held, held_labels = task_ids(task, 512, args, gen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    amp = torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")
    start, step, accuracy = time.perf_counter(), 0, 0.0
    while time.perf_counter() - start < args.train_seconds:
        model.train()
        ids, labels = task_ids(task, args.train_batch, args, gen)
        train_step(model, optimizer, amp, id_batch(ids, args.max_length, device), labels.to(device))
        step += 1
        if step % args.eval_every == 0:
            accuracy = accuracy_of(model, held, held_labels, args.max_length, device)
            if accuracy >= args.target_accuracy:
                break
    model.eval().requires_grad_(False)
    accuracy = accuracy_of(model, held, held_labels, args.max_length, device)
    return model, {"steps": step, "seconds": time.perf_counter() - start, "accuracy": accuracy}


def accuracy_of(model: Any, ids: list[list[int]], labels: Tensor, max_length: int, device: torch.device) -> float:
    model.eval()
    with torch.no_grad():
        logits = torch.cat(
            [model(**id_batch(ids[i : i + 128], max_length, device)).logits for i in range(0, len(ids), 128)]
        )
    return float((logits.argmax(-1).cpu() == labels).float().mean())


def engine_row(adapter: SequenceClassifierAdapter, batches: list[dict[str, Tensor]], **attribution: Any) -> dict:
    """The engine over the batches as the job runs them: token scores [N, S], steps, verdicts, rate."""
    section = AttributionSection(compile="off", memory_fraction=MEMORY_FRACTION[0], **attribution)
    settings = Settings.resolve(section, adapter, adapter.device, sum(len(b["input_ids"]) for b in batches))
    planner = settings.planner()
    attribute_batch(adapter, _head(batches[0], 4), settings, planner)  # warm-up
    chooser = settings.start_precision(adapter.device)  # the job's: measured on the first timed batch
    sync(adapter.device)
    start, outs = time.perf_counter(), []
    for k, batch in enumerate(batches):
        outs.append(attribute_batch(adapter, batch, settings, planner, start=chooser))
        if len(batches) > 1:  # a call cut short still says how far it got
            steps = outs[-1]["steps"].double().mean()
            print(
                f"      batch {k + 1}/{len(batches)}: {time.perf_counter() - start:.1f} s, {steps:.0f} steps",
                flush=True,
            )
    sync(adapter.device)
    seconds = time.perf_counter() - start
    choice = None if chooser is None else chooser.record()
    print(
        f"    {_describe(attribution)}: {seconds:.1f} s" + (f" ({chooser.describe()})" if chooser else ""), flush=True
    )
    return {"seconds": seconds, "precision": settings.ig.precision, "start_precision": choice, **_stack(outs)}


def _describe(attribution: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in attribution.items() if k != "batch_size")


def _head(batch: dict[str, Tensor], n: int) -> dict[str, Tensor]:
    return {k: v[:n] for k, v in batch.items()}


def _stack(outs: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    width = max(o["token_scores"].shape[1] for o in outs)
    scores = torch.cat(
        [torch.nn.functional.pad(o["token_scores"], (0, width - o["token_scores"].shape[1])) for o in outs]
    )
    return {"scores": scores, **{k: torch.cat([o[k] for o in outs]) for k in ("steps", "within", "fallback", "target")}}


def captum_row(
    adapter: SequenceClassifierAdapter, batches: list[dict[str, Tensor]], targets: Tensor, steps: int
) -> dict:
    from captum.attr import LayerIntegratedGradients

    model, device = adapter.model, adapter.device
    bf16 = device.type == "cuda"

    def forward(ids: Tensor, mask: Tensor) -> Tensor:
        with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
            return model(input_ids=ids, attention_mask=mask).logits.float()

    lig = LayerIntegratedGradients(forward, adapter.word_embeddings())
    cls, sep, pad = (SPECIAL.index(t) for t in ("[CLS]", "[SEP]", "[PAD]"))

    def run(batch: dict[str, Tensor], target: Tensor) -> Tensor:
        rows = []
        for i in range(0, len(batch["input_ids"]), 8):
            ids, mask = batch["input_ids"][i : i + 8], batch["attention_mask"][i : i + 8]
            keep = (ids == cls) | (ids == sep) | (mask == 0)
            attributions = lig.attribute(
                ids, torch.where(keep, ids, pad), target=target[i : i + 8].to(device),
                additional_forward_args=(mask,), n_steps=steps, internal_batch_size=8 * steps,
            )  # fmt: skip
            rows.append(attributions.sum(-1).float().cpu())
        return torch.cat(rows)

    run(_head(batches[0], 8), targets[:8])
    sync(device)
    start, outs, done = time.perf_counter(), [], 0
    for batch in batches:
        n = len(batch["input_ids"])
        outs.append({"token_scores": run(batch, targets[done : done + n]), "steps": torch.full((n,), steps),
                     "within": torch.zeros(n, dtype=torch.bool), "fallback": torch.zeros(n, dtype=torch.int8),
                     "target": targets[done : done + n]})  # fmt: skip
        done += n
    sync(device)
    return {"seconds": time.perf_counter() - start, "precision": "bf16 autocast", **_stack(outs)}


def measure(family: str, task: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    print(f"{family}/{task}: training ({time.strftime('%H:%M:%S')})", flush=True)
    model, trained = train(family, task, args, device)
    print(f"{family}/{task}: accuracy {trained['accuracy']:.3f} after {trained['steps']} steps", flush=True)
    if trained["accuracy"] < args.min_accuracy:  # attributions of an untrained model are rounding noise
        print(f"  not learned (below {args.min_accuracy}): skipped", flush=True)
        return {"family": family, "task": task, "train": trained, "entries": []}
    vocab = vocabulary(args.vocab)
    tokenizer = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
    adapter = SequenceClassifierAdapter(f"{family} ({task})", model, tokenizer, 2, device)
    ids, _ = task_ids(task, args.samples, args, torch.Generator().manual_seed(2))
    ids.sort(key=len, reverse=True)
    batches = [id_batch(ids[i : i + args.batch], args.max_length, device) for i in range(0, len(ids), args.batch)]
    batches = [{k: v[:, : int(b["attention_mask"].sum(1).max())] for k, v in b.items()} for b in batches]
    if args.rates_only:
        return {"family": family, "task": task, "train": trained, "entries": [], "rates": rates(adapter, task, args)}
    strict = {"use_amp": False, "tf32": False}
    refs = {
        "gl2000": engine_row(adapter, batches, n_steps=args.reference_steps, batch_size=args.batch, **strict),
    }
    if not args.skip_fine:
        refs["fine"] = engine_row(
            adapter, batches, n_steps="auto", tolerance=FINE_TOLERANCE, max_steps=8193, batch_size=args.batch, **strict
        )
    rows: dict[str, dict] = {}
    for tol in args.tolerances:
        rows[f"auto {tol:g}, defaults (fp16 weights + fallback)"] = engine_row(
            adapter, batches, n_steps="auto", tolerance=tol, batch_size=args.batch
        )
        rows[f"auto {tol:g}, tf32"] = engine_row(
            adapter, batches, n_steps="auto", tolerance=tol, batch_size=args.batch, use_amp=False, tf32=True
        )
    if not args.skip_captum:
        rows[f"Captum LIG, bf16 autocast, {args.captum_steps} steps"] = captum_row(
            adapter, batches, refs["gl2000"]["target"], args.captum_steps
        )
    result = {"family": family, "task": task, "train": trained, "entries": summarize(refs, rows, args)}
    if args.rate_samples:
        result["rates"] = rates(adapter, task, args)
    return result


def rates(adapter: SequenceClassifierAdapter, task: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Samples/s of the auto rows at the loosest tolerance and of Captum on --rate-samples other texts (the rates
    a long run sees: the per-run costs spread over many batches)."""
    ids, _ = task_ids(task, args.rate_samples, args, torch.Generator().manual_seed(3))
    ids.sort(key=len, reverse=True)
    batches = [
        id_batch(ids[i : i + args.batch], args.max_length, adapter.device) for i in range(0, len(ids), args.batch)
    ]
    batches = [{k: v[:, : int(b["attention_mask"].sum(1).max())] for k, v in b.items()} for b in batches]
    tol = max(args.tolerances)
    runs = {
        f"auto {tol:g}, defaults (fp16 weights + fallback)": {},
        f"auto {tol:g}, tf32": {"use_amp": False, "tf32": True},
        f"auto {tol:g}, fp16 weights, no fallback": {"full_precision_fallback": False},
    }
    out = []
    for name, options in runs.items():
        row = engine_row(adapter, batches, n_steps="auto", tolerance=tol, batch_size=args.batch, **options)
        out.append({"row": name, "samples": len(ids), "samples_per_s": len(ids) / row["seconds"], "mean_steps": float(row["steps"].double().mean()),
                    "full_precision": int((row["fallback"] > 0).sum()), "start_precision": row["start_precision"]})  # fmt: skip
    if not args.skip_captum:
        targets = torch.cat([attribute_batch_targets(adapter, b) for b in batches])
        row = captum_row(adapter, batches, targets, args.captum_steps)
        out.append({"row": f"Captum LIG, bf16 autocast, {args.captum_steps} steps", "mean_steps": args.captum_steps, "samples": len(ids),
                    "samples_per_s": len(ids) / row["seconds"], "full_precision": 0, "start_precision": None})  # fmt: skip
    return out


def attribute_batch_targets(adapter: SequenceClassifierAdapter, batch: dict[str, Tensor]) -> Tensor:
    """The fp32 prediction of each text (the target the runs explain)."""
    with torch.no_grad():
        return adapter.model(**batch).logits.float().argmax(-1).cpu()


def summarize(refs: dict[str, dict], rows: dict[str, dict], args: argparse.Namespace) -> list[dict[str, Any]]:
    gl, fine = refs["gl2000"]["scores"], refs["fine"]["scores"] if "fine" in refs else None
    out = [
        {"row": f"fixed {args.reference_steps} GL, strict fp32 (reference)", **_figures(refs["gl2000"], gl, fine, None)}
    ]
    if fine is not None:
        out.append({"row": f"auto {FINE_TOLERANCE:g}, strict fp32 (fine reference)", **_figures(refs["fine"], gl, fine, None)})  # fmt: skip
    for name, row in rows.items():
        tol = float(name.split()[1].rstrip(",")) if name.startswith("auto") else None
        out.append({"row": name, **_figures(row, gl, fine, tol)})
    return out


def _figures(row: dict, gl: Tensor, fine: Tensor | None, tol: float | None) -> dict[str, Any]:
    """A row's figures; with no fine reference (--skip-fine) its columns are NaN ("—" in the table)."""
    err_gl = relative_difference(row["scores"], gl)
    err_fine = relative_difference(row["scores"], fine) if fine is not None else torch.full_like(err_gl, float("nan"))
    figures = {
        "samples_per_s": len(row["scores"]) / row["seconds"],
        "mean_steps": float(row["steps"].double().mean()),
        "err_gl_median": float(err_gl.median()), "err_gl_max": float(err_gl.max()),
        "err_fine_median": float(err_fine.median()), "err_fine_max": float(err_fine.max()),
        "full_precision": int((row["fallback"] > 0).sum()),
        "fallback_reasons": torch.bincount(row["fallback"].long(), minlength=4).tolist(),
    }  # fmt: skip
    if tol is not None:
        within = row["within"]
        figures |= {
            "reported_within": int(within.sum()),
            "flagged": int((~within).sum()),
            "silent_misses_fine": int((within & (err_fine > tol)).sum()) if fine is not None else "—",
            "silent_misses_gl": int((within & (err_gl > tol)).sum()),
            "true_within_fine": int((err_fine <= tol).sum()) if fine is not None else None,
        }
    return figures


def render(meta: dict[str, Any], results: list[dict[str, Any]]) -> str:
    lines = [
        "# IG to a tolerance: conformance on families and tasks the engine was not tuned on",
        "",
        f"- date: {meta['date']}; device: {meta['device']}; torch {meta['torch']}, transformers "
        f"{meta['transformers']}, captum {meta['captum']}",
        f"- command: `{meta['command']}`",
        f"- models: {meta['layers']} layers, hidden {meta['hidden']}, {meta['heads']} heads, trained here (see the "
        f"script); {meta['samples']} held-out texts of {meta['min_words']}-{meta['max_words']} words, batches of "
        f"{meta['batch']} in length order, [PAD] baseline keeping [CLS]/[SEP], target = the fp32 prediction",
        "- error: per sample max |a - b| / max |b| of the token scores; vs GL = against fixed 2000 Gauss-Legendre "
        "steps in strict fp32, vs fine = against the adaptive panels to 1e-4 in strict fp32",
        "- within: samples the run reports within its tolerance; silent misses: of those, samples whose error "
        "against the reference exceeds the tolerance (vs fine / vs GL)",
        *([f"- note: {meta['note']}"] if meta.get("note") else []),
        "",
    ]
    for res in results:
        t = res["train"]
        if not res["entries"] and not res.get("rates"):
            lines += [f"## {res['family']}, {res['task']}: not learned (held-out accuracy {t['accuracy']:.3f})", ""]
            continue
        lines += [
            f"## {res['family']}, {res['task']} (held-out accuracy {t['accuracy']:.3f}, {t['steps']} training steps)",
            "",
        ]
        if not res["entries"]:
            lines += _render_rates(res.get("rates"))
            continue
        lines += [
            "| row | samples/s | mean steps | error vs fine (median / max) | error vs GL (median / max) | "
            "within / flagged | silent misses (fine / GL) | full precision |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for e in res["entries"]:
            verdict = (
                f"{e['reported_within']} / {e['flagged']} | {e['silent_misses_fine']} / {e['silent_misses_gl']}"
                if "reported_within" in e
                else "— | —"
            )
            lines.append(
                f"| {e['row']} | {e['samples_per_s']:.1f} | {e['mean_steps']:.1f} | "
                f"{_pair(e['err_fine_median'], e['err_fine_max'])} | {_pair(e['err_gl_median'], e['err_gl_max'])} | {verdict} | "
                f"{e['full_precision']} |"
            )
        lines.append("")
        lines += _render_rates(res.get("rates"))
    return "\n".join(lines)


def _pair(median: float, worst: float) -> str:
    return "—" if math.isnan(median) else f"{median:.1e} / {worst:.1e}"


def _render_rates(rates: list[dict[str, Any]] | None) -> list[str]:
    if not rates:
        return []
    n = rates[0].get("samples")
    captum = next((r["samples_per_s"] for r in rates if r["row"].startswith("Captum")), None)
    lines = [
        f"Rates on {n} other texts (batches as above; 40k: 40,000 / samples/s, extrapolated):",
        "",
        "| row | samples/s | mean steps | full precision | x Captum | min for 40k | start precision |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rates:
        choice = r["start_precision"]
        said = (
            "—"
            if not choice
            else (
                f"time ratio {choice['time_ratio']:.2f}, expected {choice['expected_ratio']:.2f}; "
                f"{choice['samples']['reduced']} started reduced, {choice['samples']['full']} full"
            )
        )
        times = f"{r['samples_per_s'] / captum:.2f}" if captum else "—"
        lines.append(
            f"| {r['row']} | {r['samples_per_s']:.1f} | {r['mean_steps']:.1f} | {r['full_precision']} | {times} | "
            f"{40000 / r['samples_per_s'] / 60:.1f} | {said} |"
        )
    return [*lines, ""]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models on the CPU: checks the script")
    parser.add_argument("--out", type=Path, help="markdown results file (a .json beside it)")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--min-words", type=int, default=14)
    parser.add_argument("--max-words", type=int, default=126)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--train-batch", type=int, default=64)
    parser.add_argument("--train-seconds", type=float, default=20)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--target-accuracy", type=float, default=0.98)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--min-accuracy", type=float, default=0.9, help="models below it are reported as not learned")
    parser.add_argument("--reference-steps", type=int, default=2000)
    parser.add_argument("--tolerances", type=float, nargs="+", default=[1e-2, 1e-3])
    parser.add_argument("--captum-steps", type=int, default=50)
    parser.add_argument("--skip-captum", action="store_true")
    parser.add_argument(
        "--skip-fine", action="store_true", help="no fine reference (its strict fp32 steps can take minutes)"
    )
    parser.add_argument("--rate-samples", type=int, default=1024, help="texts of the rate rows (0: none)")
    parser.add_argument("--merge", type=Path, nargs="+", help="render these .json results together into --out")
    parser.add_argument("--rates-only", action="store_true", help="train, then only the rate rows")
    parser.add_argument("--memory-fraction", type=float, default=0.9, help="of the free GPU memory, for chunks")
    parser.add_argument("--note", default="", help="a line the results file carries (e.g. how the GPU was shared)")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.heads, args.vocab, args.samples, args.batch = 2, 32, 2, 512, 8, 8
        args.min_words, args.max_words, args.max_length, args.train_seconds = 3, 12, 16, 5
        args.reference_steps, args.captum_steps, args.families = 200, 8, ["bert", "distilbert"]
        args.min_accuracy, args.rate_samples = 0.0, 16
        args.tasks = ["majority"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    MEMORY_FRACTION[0] = args.memory_fraction
    if args.merge:  # results of several processes (one GPU each), in the order given
        parts = [json.loads(p.read_text()) for p in args.merge]
        meta = {**parts[0]["meta"], "command": " ".join(p["meta"]["command"] for p in parts)}
        text = render(meta, [r for p in parts for r in p["results"]])
        if args.out:
            args.out.write_text(text)
        print(text)
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    meta = {
        "date": datetime.date.today().isoformat(), "device": device_name(device), "torch": torch.__version__,
        "transformers": transformers.__version__, "captum": _version("captum") or "not run",
        "command": " ".join(["python", *map(shlex.quote, sys.argv)]), **{k: v for k, v in vars(args).items() if k != "out"},
    }  # fmt: skip
    results = []
    for family in args.families:
        for task in args.tasks:
            results.append(measure(family, task, args, device))
            if args.out:  # after each model: what was measured survives a time limit
                args.out.write_text(render(meta, results))
                args.out.with_suffix(".json").write_text(
                    json.dumps({"meta": meta, "results": results}, default=str, indent=1)
                )
    print(render(meta, results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
