"""Memory planner accuracy on a real GPU: predicted against measured peak memory of training steps.

Each case (Qwen2-0.5B, Llama-1B- and Mistral-shaped decoders at sequence length 1024, BERT-base and GPT-2 small;
full fine-tune, LoRA, frozen encoder, contrastive samples per anchor; gradient checkpointing on and off; bf16
autocast and fp32) runs the same plain HF loop (`model(input_ids, labels=...)`, backward, step,
`zero_grad(set_to_none=True)`) and has four parts, each with its own fresh probe processes, so that one part of one
case can run alone under a time limit and the JSON files be merged afterwards:
- accuracy: measured truth, the loop at the case's batch for --steps steps in a fresh process: footprint =
  torch's peak reserved memory over all steps + the memory outside torch (CUDA context and kernels: total - free
  - reserved), and torch's peak allocated (tensors alone); the closed form, `estimate(...).total`, no GPU
  involved; the measured tier at the case's batch as `plan --show --profile` prints it (one probe of 3 warm-up +
  5 measured steps in a fresh process: its footprint); a line through such probes at 1/2 and 3/4 of the batch,
  extrapolated to it (how far a fit from smaller batches is off); accelerate's estimate-memory figure (largest
  of its training components, batch 1) when accelerate imports.
- closed-form: the closed form's recommendation for the GPU's budget (--margin x its memory as NVML reports it;
  the planner's rule: the largest micro-batch under the budget less `CLOSED_FORM_HEADROOM`) runs --steps steps.
- measured-plan: the measured tier as `gpuopt-tui plan --profile` runs it (probes from the closed-form guess, a
  line fit, a confirming probe that shrinks x0.9 while it does not fit), its recommended batch and the peak it
  predicts there;
- measured-run: that batch runs --steps steps (after measured-plan, or taken from its JSON with --plan), and the
  prediction's error against that run's footprint.
A recommendation passes when it does not run out of memory, the allocator never had to retry, and its peak is
80-100% of the budget.

    python benchmarks/memory_planner_bench.py --list                  # the cases, one a line
    python benchmarks/memory_planner_bench.py --cases bert-frozen-bf16 --parts accuracy --out a.md
    python benchmarks/memory_planner_bench.py --cases bert-frozen-bf16 --parts measured-plan --out p.md
    python benchmarks/memory_planner_bench.py --cases bert-frozen-bf16 --parts measured-run --plan p.json --out r.md
    python benchmarks/memory_planner_bench.py --merge a.json p.json r.json --out memory_planner_h100.md
    python benchmarks/memory_planner_bench.py --quick                 # CPU, tiny models, simulated memory: plumbing
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recommend_verdict import budget_share, passes, pretend_card  # noqa: E402

from gpuopt_tui.core.planner import gpu as gpu_memory  # noqa: E402
from gpuopt_tui.core.planner.estimate import estimate  # noqa: E402
from gpuopt_tui.core.planner.fit import ProbeResult, fit_line, shrink  # noqa: E402
from gpuopt_tui.core.planner.measure import (  # noqa: E402
    ALLOC_CONF,
    MEASURED_STEPS,
    WARMUP_STEPS,
    measure,
    probe_request,
    run_probe,
)
from gpuopt_tui.core.planner.model_spec import ModelSpec, spec_from_config  # noqa: E402
from gpuopt_tui.core.planner.search import (  # noqa: E402
    CLOSED_FORM_HEADROOM,
    Budget,
    closed_form,
    largest_batch,
)
from gpuopt_tui.core.planner.train_setup import GiB, MiB, TrainSetup  # noqa: E402

BERT_BASE = {
    "model_type": "bert",
    "vocab_size": 30522,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
}
GPT2_SMALL = {
    "model_type": "gpt2",
    "vocab_size": 50257,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_positions": 1024,
    "activation_function": "gelu_new",
}
DECODERS = {  # decoder shapes at 0.5-1.3B parameters (random weights)
    "qwen2": {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
    },
    "llama": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
    },
    "mistral": {
        "model_type": "mistral",
        "vocab_size": 32768,
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "intermediate_size": 5632,
        "max_position_embeddings": 32768,
        "sliding_window": None,
    },
}
LOOP = "plain"  # the truth: model(input_ids, labels=...), backward, step, zero_grad(set_to_none=True)
RUN_STEPS = 50
# --quick: a pretend card with 8 MiB to spare beyond the fixed overheads and the closed form's headroom, so
# recommended batches stay CPU-sized
QUICK_GPU = pretend_card(8 * MiB, 0.85, CLOSED_FORM_HEADROOM)
QUICK_CASES = ("bert-lora-bf16", "gpt2-ckpt-bf16", "qwen2-lora", "llama-ckpt", "mistral-lora-ckpt")
TINY = {  # --quick: the same families at test size
    "bert": {
        **BERT_BASE,
        "vocab_size": 200,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": 64,
    },
    "gpt2": {**GPT2_SMALL, "vocab_size": 200, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
    **{
        family: {
            **config,
            "vocab_size": 500,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "intermediate_size": 64,
            "max_position_embeddings": 64,
        }
        for family, config in DECODERS.items()
    },
}


@dataclass(frozen=True)
class Case:
    name: str
    family: str  # bert or gpt2
    task: str
    setup: TrainSetup
    what: str


QV = ("q_proj", "v_proj")


def _lm(micro_batch: int, **kw: Any) -> TrainSetup:
    return TrainSetup(micro_batch=micro_batch, seq_len=1024, loop=LOOP, **kw)


CASES = [
    Case("qwen2-full", "qwen2", "causal_lm", _lm(4), "Qwen2-0.5B, full, bf16, s1024"),
    Case(
        "qwen2-lora",
        "qwen2",
        "causal_lm",
        _lm(8, trainable="lora", lora_rank=16, lora_targets=QV),
        "Qwen2-0.5B, LoRA r16 q/v, bf16, s1024",
    ),
    Case("qwen2-ckpt", "qwen2", "causal_lm", _lm(8, gradient_checkpointing=True), "Qwen2-0.5B, full, ckpt, s1024"),
    Case("llama-full", "llama", "causal_lm", _lm(2), "Llama-1B shapes, full, bf16, s1024"),
    Case("llama-ckpt", "llama", "causal_lm", _lm(4, gradient_checkpointing=True), "Llama-1B shapes, full, ckpt, s1024"),
    Case(
        "llama-lora",
        "llama",
        "causal_lm",
        _lm(4, trainable="lora", lora_rank=16, lora_targets=QV),
        "Llama-1B shapes, LoRA r16 q/v, bf16, s1024",
    ),
    Case("mistral-full", "mistral", "causal_lm", _lm(4), "Mistral shapes 1.1B, full, bf16, s1024"),
    Case(
        "mistral-lora-ckpt",
        "mistral",
        "causal_lm",
        _lm(8, trainable="lora", lora_rank=16, lora_targets=("all-linear",), gradient_checkpointing=True),
        "Mistral shapes 1.1B, LoRA r16 all-linear, ckpt, s1024",
    ),
    Case("bert-full-bf16", "bert", "classification", TrainSetup(micro_batch=64), "BERT-base, full, bf16, s128"),
    Case(
        "bert-ckpt-bf16",
        "bert",
        "classification",
        TrainSetup(micro_batch=128, gradient_checkpointing=True),
        "BERT-base, full, checkpointing, bf16, s128",
    ),
    Case(
        "bert-frozen-bf16",
        "bert",
        "classification",
        TrainSetup(micro_batch=256, trainable="frozen_encoder"),
        "BERT-base, frozen encoder, bf16, s128",
    ),
    Case(
        "bert-lora-bf16",
        "bert",
        "classification",
        TrainSetup(micro_batch=64, seq_len=256, trainable="lora", lora_targets=("query", "value")),
        "BERT-base, LoRA r8 q/v, bf16, s256",
    ),
    Case(
        "bert-full-fp32",
        "bert",
        "classification",
        TrainSetup(micro_batch=32, precision="fp32"),
        "BERT-base, full, fp32, s128",
    ),
    Case(
        "bert-contrastive",
        "bert",
        "embedding",
        TrainSetup(micro_batch=16, seq_len=64, n_positives=3, n_negatives=4, gradient_checkpointing=True),
        "BERT-base, contrastive 1+3+4 per anchor, checkpointing, bf16, s64",
    ),
    Case("gpt2-full-bf16", "gpt2", "causal_lm", TrainSetup(micro_batch=8, seq_len=512), "GPT-2, full, bf16, s512"),
    Case(
        "gpt2-ckpt-bf16",
        "gpt2",
        "causal_lm",
        TrainSetup(micro_batch=16, seq_len=512, gradient_checkpointing=True),
        "GPT-2, full, checkpointing, bf16, s512",
    ),
    Case(
        "gpt2-lora-bf16",
        "gpt2",
        "causal_lm",
        TrainSetup(micro_batch=16, seq_len=512, trainable="lora", lora_targets=("c_attn",)),
        "GPT-2, LoRA r8 c_attn, bf16, s512",
    ),
    Case(
        "gpt2-full-fp32",
        "gpt2",
        "causal_lm",
        TrainSetup(micro_batch=8, seq_len=512, precision="fp32"),
        "GPT-2, full, fp32, s512",
    ),
]


def _config(case: Case, quick: bool) -> dict[str, Any]:
    if quick:
        return TINY[case.family]
    return {"bert": BERT_BASE, "gpt2": GPT2_SMALL, **DECODERS}[case.family]


def _setup(case: Case, quick: bool) -> TrainSetup:
    setup = dataclasses.replace(case.setup, loop=LOOP)  # every case against the same plain HF loop
    if not quick:
        return setup
    return dataclasses.replace(setup, micro_batch=max(4, setup.micro_batch // 8), seq_len=16)


def accelerate_estimate(config: dict[str, Any], task: str, precision: str) -> int | str:
    """accelerate estimate-memory's "Training using Adam" figure: the largest of its components, batch 1 (or
    why there is none)."""
    try:
        import torch
        import transformers
        from accelerate import init_empty_weights
        from accelerate.commands.estimate import estimate_training_usage
        from accelerate.utils import calculate_maximum_sizes
    except ImportError as e:
        return f"cannot import it: {e}"
    auto = {
        "classification": transformers.AutoModelForSequenceClassification,
        "causal_lm": transformers.AutoModelForCausalLM,
        "masked_lm": transformers.AutoModelForMaskedLM,
        "embedding": transformers.AutoModel,
    }[task]
    fields = dict(config)
    try:  # a third party's figure for comparison: its failure is a note in the table, not the end of the run
        with init_empty_weights():
            model = auto.from_config(transformers.AutoConfig.for_model(fields.pop("model_type"), **fields))
        total, _ = calculate_maximum_sizes(model.to(torch.float32))
        usage = estimate_training_usage(total, "float32" if precision == "fp32" else "bfloat16")
    except Exception as e:
        return f"its estimate failed: {type(e).__name__}: {e}"
    return int(max(usage.values()))


class Prober:
    """Probes of one case in fresh processes; with --quick they run on the CPU and their GPU memory is simulated
    by the closed form (the live-tensor peak the CPU probe reports stays as `max_allocated`)."""

    def __init__(self, case: Case, args: argparse.Namespace) -> None:
        self.config, self.task = _config(case, args.quick), case.task
        self.spec: ModelSpec = spec_from_config(self.config, case.family, case.task)
        self.device = "cpu" if args.quick else f"cuda:{args.gpu_index}"
        self.quick = args.quick

    def request(self, setup: TrainSetup, steps: int, warmup: int = 0) -> dict[str, Any]:
        return probe_request(self.config, self.task, setup, self.device, steps=steps, warmup=warmup)

    def run(self, request: Mapping[str, Any]) -> ProbeResult:
        result = run_probe(request, timeout=600)
        if result.error:
            raise SystemExit(f"probe {self.task} b={request['micro_batch']} failed: {result.error}")
        if self.quick:
            fields = {k: request[k] for k in TrainSetup.__dataclass_fields__}
            est = estimate(self.spec, TrainSetup(**{**fields, "lora_targets": tuple(fields["lora_targets"])}))
            result = dataclasses.replace(result, max_reserved=est.reserved, context=est.total - est.reserved)
        return result

    def probe(self, setup: TrainSetup, steps: int) -> ProbeResult:
        return self.run(self.request(setup, steps))


def _err(predicted: float | None, measured: float) -> float | None:
    return None if predicted is None or measured <= 0 else predicted / measured - 1


def _gpu(args: argparse.Namespace) -> tuple[int, str]:
    """The memory the budget is a share of, as the planner reads it (NVML total less the driver's reserved share),
    and the card's name."""
    if args.quick:
        return QUICK_GPU, "cpu"
    found = gpu_memory.detect(args.gpu_index)
    if found is None:
        raise SystemExit(f"no GPU {args.gpu_index} found through NVML: the budget is a share of its memory")
    return found.total, found.label


def accuracy(case: Case, setup: TrainSetup, prober: Prober, row: dict[str, Any], steps: int) -> None:
    b = setup.micro_batch
    print(f"[{case.name}] truth probe at b={b}", flush=True)
    truth = prober.probe(setup, steps=steps)  # a plain run of the loop: its peak over all its steps
    row.update(batch=b, measured=truth.footprint, allocated=truth.max_allocated)
    row["context"] = truth.context
    row["closed_form"] = estimate(prober.spec, setup).total
    print(f"[{case.name}] measured tier at b={b}", flush=True)
    row["measured_tier"] = prober.run(prober.request(setup, MEASURED_STEPS, WARMUP_STEPS)).footprint
    lo, mid = max(1, b // 2), max(2, 3 * b // 4)
    print(f"[{case.name}] fit probes at b={lo}, {mid}", flush=True)
    points = [prober.run(prober.request(setup.with_batch(x), MEASURED_STEPS, WARMUP_STEPS)) for x in (lo, mid)]
    fit = fit_line([(p.sequences, p.max_reserved) for p in points])
    row["line_from_smaller"] = fit.predict(truth.sequences) + max(p.context for p in points)
    found = accelerate_estimate(prober.config, case.task, setup.precision)
    row["accelerate"], row["accelerate_note"] = (found, "") if isinstance(found, int) else (None, found)
    for key in ("closed_form", "measured_tier", "line_from_smaller", "accelerate"):
        row[f"{key}_error"] = _err(row.get(key), row["measured"])


def run_recommended(
    case: Case, entry: Mapping[str, Any], setup: TrainSetup, prober: Prober, budget: Budget, steps: int
) -> dict[str, Any]:
    """`entry` (a tier and its recommended batch) with what `steps` steps at that batch did."""
    print(f"[{case.name}] {entry['tier']} recommendation b={entry['batch']}: {steps} steps", flush=True)
    run = prober.probe(setup.with_batch(entry["batch"]), steps=steps)
    return {
        **entry,
        "prediction_error": None if run.oom or "predicted" not in entry else _err(entry["predicted"], run.footprint),
        "oom": run.oom,
        "retries": run.num_alloc_retries,
        "footprint": run.footprint,
        "allocated": run.max_allocated,
        "of_budget": None if run.oom else budget_share(run.footprint, budget.limit),
    }


def closed_form_batch(prober: Prober, setup: TrainSetup, budget: Budget) -> int:
    """The closed form's recommendation: its largest micro-batch under the budget less its headroom."""
    return largest_batch(closed_form(prober.spec), setup, budget.search_limit(CLOSED_FORM_HEADROOM))


def measured_plan(case: Case, setup: TrainSetup, prober: Prober, budget: Budget) -> dict[str, Any]:
    """The planner's measured tier (`measure`, started from the closed-form guess) and its recommended batch."""
    plan = measure(
        lambda b: prober.request(setup.with_batch(b), MEASURED_STEPS, WARMUP_STEPS),
        setup.sequences_per_example,
        budget,
        max(1, closed_form_batch(prober, setup, budget)),
        probe=prober.run,
        log=lambda line: print(f"[{case.name}]   {line}", flush=True),
    )
    chain = [plan.b_max]  # the confirmation starts at b_max and shrinks x0.9 down to the confirmed batch
    while chain[-1] > plan.micro_batch:
        chain.append(shrink(chain[-1]))
    peak = plan.peak_model()
    batch = largest_batch(peak, setup, budget.search_limit(plan.headroom))
    return {
        "tier": "measured",
        "batch": batch,
        "predicted": peak(setup.with_batch(batch)),
        "probes": len(plan.probes),
        "shrinks": len(chain) - 1,
        "headroom": plan.headroom,
    }


PARTS = ("accuracy", "closed-form", "measured-plan", "measured-run")
ALIASES = {"measured": ("measured-plan", "measured-run"), "all": PARTS}


def _planned(case: Case, plan_files: Sequence[Path]) -> dict[str, Any]:
    """The measured tier's plan for `case` from an earlier run's JSON (its measured-plan part)."""
    for path in plan_files:
        for row in json.loads(path.read_text())["rows"]:
            for entry in row.get("recommended", ()) if row["case"] == case.name else ():
                if entry["tier"] == "measured":
                    return {
                        k: entry[k]
                        for k in ("tier", "batch", "predicted", "probes", "shrinks", "headroom")
                        if k in entry
                    }
    raise SystemExit(f"[{case.name}] measured-run: no measured plan for this case in {', '.join(map(str, plan_files))}")


def run_case(case: Case, args: argparse.Namespace, parts: Sequence[str]) -> dict[str, Any]:
    setup = _setup(case, args.quick)
    prober = Prober(case, args)
    total, card = _gpu(args)
    budget = Budget(total, args.margin)
    row: dict[str, Any] = {"case": case.name, "what": case.what, "device": card, "recommended": [], "seconds": {}}
    recommended: dict[str, dict[str, Any]] = {}  # by tier
    for part in parts:
        started = time.perf_counter()
        if part == "accuracy":
            accuracy(case, setup, prober, row, args.steps)
        elif part == "closed-form":
            batch = closed_form_batch(prober, setup, budget)
            predicted = estimate(prober.spec, setup.with_batch(batch)).total
            entry = {"tier": "closed form", "batch": batch, "predicted": predicted, "probes": 0}
            recommended["closed form"] = run_recommended(case, entry, setup, prober, budget, args.steps)
        elif part == "measured-plan":
            recommended["measured"] = measured_plan(case, setup, prober, budget)
        else:
            planned = recommended.get("measured") or _planned(case, args.plan or ())
            recommended["measured"] = run_recommended(case, planned, setup, prober, budget, args.steps)
        row["seconds"][part] = round(time.perf_counter() - started, 1)
        print(f"[{case.name}] {part}: {row['seconds'][part]:.0f} s", flush=True)
    row["recommended"] = list(recommended.values())
    return row


def _gib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / GiB:.2f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def merge_rows(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per case (in CASES order) from rows of several runs: the parts' fields together, one
    recommendation per tier (a later run's fields win), closed form first."""
    merged: dict[str, dict[str, Any]] = {}
    tiers: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        into = merged.setdefault(row["case"], {"seconds": {}})
        for key, value in row.items():
            if key == "recommended":
                for entry in value:
                    tiers.setdefault(row["case"], {}).setdefault(entry["tier"], {}).update(entry)
            elif key == "seconds":
                into["seconds"].update(value)
            else:
                into[key] = value
    for case, row in merged.items():
        row["recommended"] = sorted(tiers.get(case, {}).values(), key=lambda x: x["tier"] != "closed form")
    order = {c.name: i for i, c in enumerate(CASES)}
    return sorted(merged.values(), key=lambda r: order.get(r["case"], len(order)))


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Memory planner: predicted vs measured peak memory",
        "",
        f"- date: {meta['date']}",
        f"- card: {meta['card']}",
        f"- versions: {meta['versions']}",
        f"- allocator: PYTORCH_CUDA_ALLOC_CONF={ALLOC_CONF}; loop: plain HF loop (model(input_ids, labels=...), backward, step, zero_grad(set_to_none=True))",
        f"- command: `{meta['command']}`",
        "",
        "Measured = torch peak reserved + memory outside torch (context, kernels) after the steps; tensors = torch"
        " peak allocated. Measured tier = what `plan --show --profile` prints: one probe of the setup (3 warm-up + 5"
        " measured steps) in a fresh process. Line from smaller = a line through such probes at 1/2 and 3/4 of the"
        " batch, extrapolated to it. accelerate = its estimate-memory training figure (largest component, batch 1).",
        "",
        "| case | batch | measured GiB | tensors GiB | closed form GiB (error) | measured tier GiB (error) |"
        " line from smaller GiB (error) | accelerate GiB (error) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    measured = [r for r in rows if "measured" in r]
    for r in measured:
        lines.append(
            f"| {r['what']} | {r['batch']} | {_gib(r['measured'])} | {_gib(r.get('allocated'))} | "
            f"{_gib(r['closed_form'])} ({_pct(r.get('closed_form_error'))}) | {_gib(r.get('measured_tier'))} "
            f"({_pct(r.get('measured_tier_error'))}) | {_gib(r.get('line_from_smaller'))} "
            f"({_pct(r.get('line_from_smaller_error'))}) | {_gib(r.get('accelerate'))} ({_pct(r.get('accelerate_error'))}) |"
        )
    for key, label in (
        ("closed_form", "closed form"),
        ("measured_tier", "measured tier"),
        ("line_from_smaller", "line from smaller batches"),
        ("accelerate", "accelerate"),
    ):
        errors = [abs(r[f"{key}_error"]) for r in measured if r.get(f"{key}_error") is not None]
        if errors:
            lines.append(f"\nMedian |error| {label}: {statistics.median(errors):.1%} (max {max(errors):.1%})")
    notes = sorted({r["accelerate_note"] for r in measured if r.get("accelerate_note")})
    lines += [f"\naccelerate: {note}" for note in notes]
    recs = [(r, x) for r in rows for x in r.get("recommended", [])]
    if recs:
        lines += [
            "",
            f"## Recommended batches under {meta['margin']:.0%} of the GPU, {meta['steps']} steps each",
            "",
            f"Closed form: its largest micro-batch under the budget less {CLOSED_FORM_HEADROOM:.0%} kept for its "
            "error. Measured: the measured tier's recommendation (probes from the closed-form guess, a line fit, a "
            f"confirming probe that shrinks x0.9 while it does not fit; the probes' measured drift kept back). ok = no out-of-memory error, no allocator "
            "retries, peak 80-100% of the budget.",
            "",
            "| case | tier | batch | probes (x0.9 shrinks) | out of memory | allocator retries | predicted GiB | "
            "peak GiB (prediction error) | tensors GiB | of budget | ok |",
            "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---|",
        ]
        for r, x in recs:
            shrinks = f" ({x['shrinks']})" if x.get("shrinks") else ""
            if "footprint" not in x:
                lines.append(
                    f"| {r['case']} | {x['tier']} | {x['batch']} | {x['probes']}{shrinks} | not run yet ||||||"
                )
                continue
            ok = passes(x["oom"], x["retries"], x["of_budget"])
            lines.append(
                f"| {r['case']} | {x['tier']} | {x['batch']} | {x.get('probes', 0)}{shrinks} | "
                f"{'yes' if x['oom'] else 'no'} | {x['retries']} | {_gib(x.get('predicted'))} | "
                f"{_gib(x['footprint'])} ({_pct(x.get('prediction_error'))}) | "
                f"{_gib(x.get('allocated'))} | "
                f"{'n/a' if x['of_budget'] is None else format(x['of_budget'], '.0%')} | {'yes' if ok else 'NO'} |"
            )
    timing = [f"{r['case']} " + ", ".join(f"{k} {v:.0f} s" for k, v in r["seconds"].items()) for r in rows]
    lines += ["", "Seconds per part: " + "; ".join(t for r, t in zip(rows, timing) if r.get("seconds"))]
    return "\n".join(lines) + "\n"


def _versions() -> str:
    found = []
    for name in ("torch", "transformers", "accelerate"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return f"Python {platform.python_version()}, " + ", ".join(found)


def measure_cases(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[list[dict[str, Any]], dict]:
    wanted = set(args.cases.split(",")) if args.cases else (set(QUICK_CASES) if args.quick else None)
    unknown = (wanted or set()) - {c.name for c in CASES}
    if unknown:
        parser.error(f"unknown case(s): {', '.join(sorted(unknown))}")
    parts = [p for name in args.parts.split(",") for p in ALIASES.get(name, (name,))]
    if set(parts) - set(PARTS):
        parser.error(f"--parts: expected a comma-separated subset of {', '.join((*PARTS, *ALIASES))}")
    if "measured-run" in parts and "measured-plan" not in parts and not args.plan:
        parser.error("--parts measured-run without measured-plan needs --plan JSON (a measured-plan run's output)")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if args.quick:
        args.steps = min(args.steps, 2)
    rows = [run_case(c, args, parts) for c in CASES if wanted is None or c.name in wanted]
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "card": (rows[0]["device"] if rows else "?")
        + (" (--quick: memory simulated by the closed form)" if args.quick else ""),
        "versions": _versions(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "margin": args.margin,
        "steps": args.steps,
    }
    return rows, meta


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cases", help=f"comma-separated subset of: {', '.join(c.name for c in CASES)} (--quick: two of them)"
    )
    parser.add_argument(
        "--parts",
        default="all",
        help=f"comma-separated subset of: {', '.join(PARTS)} (measured = measured-plan,measured-run; all)",
    )
    parser.add_argument(
        "--plan", nargs="+", type=Path, metavar="JSON", help="for measured-run alone: the measured-plan run's JSON"
    )
    parser.add_argument("--list", action="store_true", help="print the cases, one a line, and exit")
    parser.add_argument("--gpu-index", type=int, default=0)
    parser.add_argument("--margin", type=float, default=0.85)
    parser.add_argument("--steps", type=int, default=RUN_STEPS, help="steps each recommended batch must run")
    parser.add_argument(
        "--quick", action="store_true", help="CPU, tiny models, memory simulated: checks the plumbing, not the numbers"
    )
    parser.add_argument("--out", type=Path, help="write the markdown table here (and the raw rows as JSON beside)")
    parser.add_argument(
        "--merge", nargs="+", type=Path, metavar="JSON", help="no probes: one table from earlier runs' JSON files"
    )
    args = parser.parse_args()
    if args.list:
        print("\n".join(c.name for c in CASES))
        return 0
    if args.merge:
        parts = [json.loads(path.read_text()) for path in args.merge]
        rows = merge_rows(row for part in parts for row in part["rows"])
        meta = {**parts[0]["meta"], "command": " ; ".join(part["meta"]["command"] for part in parts)}
    else:
        rows, meta = measure_cases(args, parser)
    text = markdown(rows, meta)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
