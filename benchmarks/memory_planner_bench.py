"""Memory planner accuracy on a real GPU: predicted against measured peak memory of training steps.

For each case (BERT-base and GPT-2 small; full fine-tune, LoRA, frozen encoder, contrastive samples per anchor;
gradient checkpointing on and off; bf16 autocast and fp32):
1. measured truth: a probe at the case's batch (fresh process, 3 steps), footprint = torch's peak reserved
   memory + the memory outside torch (CUDA context and kernels: total - free - reserved, mem_get_info);
2. closed form: `estimate(...).total`, no GPU involved;
3. measured tier: a line fitted to probes at 1/2 and 3/4 of the batch (not to the truth probe), extrapolated;
4. accelerate's estimate-memory figure (largest of its training components, batch 1) when accelerate imports.
Then, for the GPU's budget (--margin x memory): the batch each tier recommends runs --steps steps in a fresh
process; it must not run out of memory and must use at least 80% of the budget (a measured recommendation
that fails is shrunk x0.9 and retried, and the table says so).

    python benchmarks/memory_planner_bench.py --out benchmarks/results/memory_planner_h100.md
    python benchmarks/memory_planner_bench.py --cases bert-full-bf16,gpt2-full-bf16 --out part1.md
    python benchmarks/memory_planner_bench.py --merge part1.json part2.json --out memory_planner_h100.md
    python benchmarks/memory_planner_bench.py --quick     # CPU, tiny models, simulated memory: the plumbing
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpuopt_tui.core.planner.estimate import GiB, MiB, Overheads, TrainSetup, estimate  # noqa: E402
from gpuopt_tui.core.planner.fit import ProbeResult, fit_line, max_batch, shrink  # noqa: E402
from gpuopt_tui.core.planner.measure import ALLOC_CONF, probe_request, run_probe  # noqa: E402
from gpuopt_tui.core.planner.model_spec import ModelSpec, spec_from_config  # noqa: E402
from gpuopt_tui.core.planner.search import Budget, closed_form, largest_batch  # noqa: E402

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
# --quick: a pretend card with 8 MiB to spare beyond the fixed overheads, so recommended batches stay CPU-sized
QUICK_GPU = int((Overheads().context + Overheads().workspaces + Overheads().allocator + 8 * MiB) / 0.85)
QUICK_CASES = ("bert-lora-bf16", "gpt2-ckpt-bf16")
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
}


@dataclass(frozen=True)
class Case:
    name: str
    family: str  # bert or gpt2
    task: str
    setup: TrainSetup
    what: str


CASES = [
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
    return BERT_BASE if case.family == "bert" else GPT2_SMALL


def _setup(case: Case, quick: bool) -> TrainSetup:
    if not quick:
        return case.setup
    return dataclasses.replace(case.setup, micro_batch=max(4, case.setup.micro_batch // 8), seq_len=16)


def accelerate_estimate(config: dict[str, Any], task: str, precision: str) -> int | None:
    """accelerate estimate-memory's "Training using Adam" figure: the largest of its components, batch 1."""
    try:
        import torch
        import transformers
        from accelerate.commands.estimate import estimate_training_usage
        from accelerate.utils import calculate_maximum_sizes, init_empty_weights
    except ImportError:
        return None
    auto = {
        "classification": transformers.AutoModelForSequenceClassification,
        "causal_lm": transformers.AutoModelForCausalLM,
        "embedding": transformers.AutoModel,
    }[task]
    fields = dict(config)
    with init_empty_weights():
        model = auto.from_config(transformers.AutoConfig.for_model(fields.pop("model_type"), **fields))
    total, _ = calculate_maximum_sizes(model.to(torch.float32))
    usage = estimate_training_usage(total, "float32" if precision == "fp32" else "bfloat16")
    return int(max(usage.values()))


def probe(config: dict[str, Any], task: str, setup: TrainSetup, device: str, steps: int) -> ProbeResult:
    result = run_probe(probe_request(config, task, setup, device, steps=steps), timeout=600)
    if result.error:
        raise SystemExit(f"probe {task} b={setup.micro_batch} failed: {result.error}")
    if device == "cpu":  # --quick: the step ran for real; its GPU memory is simulated by the closed form
        est = estimate(spec_from_config(config, config["model_type"], task), setup)
        result = dataclasses.replace(result, max_reserved=est.reserved, context=est.total - est.reserved)
    return result


def _err(predicted: float | None, measured: float) -> float | None:
    return None if predicted is None or measured <= 0 else predicted / measured - 1


def run_case(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    config, setup = _config(case, args.quick), _setup(case, args.quick)
    spec: ModelSpec = spec_from_config(config, case.family, case.task)
    device = "cpu" if args.quick else f"cuda:{args.gpu_index}"
    b = setup.micro_batch
    print(f"[{case.name}] truth probe at b={b}", flush=True)
    truth = probe(config, case.task, setup, device, steps=3)
    row: dict[str, Any] = {"case": case.name, "what": case.what, "batch": b, "device": truth.device}
    row["measured"] = truth.footprint
    row["context"] = truth.context
    row["closed_form"] = estimate(spec, setup).total
    lo, mid = max(1, b // 2), max(2, 3 * b // 4)
    print(f"[{case.name}] fit probes at b={lo}, {mid}", flush=True)
    points = [probe(config, case.task, setup.with_batch(x), device, steps=3) for x in (lo, mid)]
    row["accelerate"] = accelerate_estimate(config, case.task, setup.precision)
    fit = fit_line([(p.sequences, p.max_reserved) for p in points])
    row["measured_tier"] = fit.predict(truth.sequences) + max(p.context for p in points)
    for key in ("closed_form", "measured_tier", "accelerate"):
        row[f"{key}_error"] = _err(row.get(key), row["measured"])
    budget = Budget(QUICK_GPU if args.quick else truth.gpu_total, args.margin)
    row["recommended"] = []
    spe = setup.sequences_per_example
    b_cf = largest_batch(closed_form(spec), setup, budget.limit)
    by_size = {p.sequences: p for p in (*points, truth)}  # the two largest batches probed
    top = [by_size[k] for k in sorted(by_size)[-2:]]
    b_fit = max_batch(
        fit_line([(p.sequences, p.max_reserved) for p in top]), budget.limit, max(p.context for p in top), spe
    )
    for tier, batch in (("closed form", b_cf), ("measured", b_fit)):
        shrinks = 0
        while True:
            print(f"[{case.name}] {tier} recommendation b={batch}: {args.steps} steps", flush=True)
            run = probe(config, case.task, setup.with_batch(batch), device, steps=args.steps)
            fits = run.ok and run.num_alloc_retries == 0 and run.footprint <= budget.limit
            if fits or tier == "closed form" or batch == 1:
                break
            batch, shrinks = shrink(batch), shrinks + 1
        row["recommended"].append(
            {
                "tier": tier,
                "batch": batch,
                "shrinks": shrinks,
                "oom": run.oom,
                "retries": run.num_alloc_retries,
                "footprint": run.footprint,
                "of_budget": run.footprint / budget.limit if not run.oom else None,
            }
        )
    return row


def _gib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / GiB:.2f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Memory planner: predicted vs measured peak memory",
        "",
        f"- date: {meta['date']}",
        f"- card: {meta['card']}",
        f"- versions: {meta['versions']}",
        f"- allocator: PYTORCH_CUDA_ALLOC_CONF={ALLOC_CONF}; loop: Lightning order (zero_grad before backward)",
        f"- command: `{meta['command']}`",
        "",
        "Measured = torch peak reserved + memory outside torch (context, kernels) after the steps. Measured tier ="
        " line through probes at 1/2 and 3/4 of the batch, extrapolated to the batch. accelerate = its"
        " estimate-memory training figure (largest component, batch 1).",
        "",
        "| case | batch | measured GiB | closed form GiB (error) | measured tier GiB (error) | accelerate GiB (error) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['what']} | {r['batch']} | {_gib(r['measured'])} | {_gib(r['closed_form'])} "
            f"({_pct(r.get('closed_form_error'))}) | {_gib(r.get('measured_tier'))} ({_pct(r.get('measured_tier_error'))})"
            f" | {_gib(r.get('accelerate'))} ({_pct(r.get('accelerate_error'))}) |"
        )
    for key, label in (
        ("closed_form", "closed form"),
        ("measured_tier", "measured tier"),
        ("accelerate", "accelerate"),
    ):
        errors = [abs(r[f"{key}_error"]) for r in rows if r.get(f"{key}_error") is not None]
        if errors:
            lines.append(f"\nMedian |error| {label}: {statistics.median(errors):.1%} (max {max(errors):.1%})")
    recs = [(r, x) for r in rows for x in r.get("recommended", [])]
    if recs:
        lines += [
            "",
            f"## Recommended batches under {meta['margin']:.0%} of the GPU, {meta['steps']} steps each",
            "",
            "| case | tier | batch | x0.9 shrinks | out of memory | allocator retries | peak GiB | of budget | ok |",
            "|---|---|---:|---:|---|---:|---:|---:|---|",
        ]
        for r, x in recs:
            ok = not x["oom"] and x["of_budget"] is not None and 0.8 <= x["of_budget"] <= 1.0
            lines.append(
                f"| {r['case']} | {x['tier']} | {x['batch']} | {x['shrinks']} | {'yes' if x['oom'] else 'no'} | "
                f"{x['retries']} | {_gib(x['footprint'])} | "
                f"{'n/a' if x['of_budget'] is None else format(x['of_budget'], '.0%')} | {'yes' if ok else 'NO'} |"
            )
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
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if args.quick:
        args.steps = min(args.steps, 2)
    rows = [run_case(c, args) for c in CASES if wanted is None or c.name in wanted]
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
    parser.add_argument("--gpu-index", type=int, default=0)
    parser.add_argument("--margin", type=float, default=0.85)
    parser.add_argument("--steps", type=int, default=20, help="steps each recommended batch must run")
    parser.add_argument(
        "--quick", action="store_true", help="CPU, tiny models, memory simulated: checks the plumbing, not the numbers"
    )
    parser.add_argument("--out", type=Path, help="write the markdown table here (and the raw rows as JSON beside)")
    parser.add_argument(
        "--merge", nargs="+", type=Path, metavar="JSON", help="no probes: one table from earlier runs' JSON files"
    )
    args = parser.parse_args()
    if args.merge:
        parts = [json.loads(path.read_text()) for path in args.merge]
        rows = [row for part in parts for row in part["rows"]]
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
