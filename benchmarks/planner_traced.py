"""The traced tier against the real step on a GPU: predicted against measured peak memory, for several families.

Each case is a model config built here (no downloads; shapes of public checkpoints, named) and a training setup.
For each case:
- traced: `gpuopt_tui.jobs.plantrace.trace`, in this process, on fake tensors living on the CPU (what the planner
  does on a machine without a GPU) and, with --devices cpu,cuda, on fake CUDA tensors (the CUDA build's autocast
  op lists and attention kernels); its peak allocated, and reserved / total by the planner's allocator model
  (`core.planner.traced.traced_estimate`);
- measured: `memprobe` in a fresh process on the GPU, the same model class, setup and loop (1 warm-up + 2 measured
  steps): `torch.cuda.max_memory_allocated()` and `max_memory_reserved()` over all steps, and the CUDA context;
- the closed form's figures where it covers the family.
Errors are against the measured figures (allocated against allocated, reserved against reserved).

    python benchmarks/planner_traced.py                          # all cases, results to $OUT or benchmarks/results
    python benchmarks/planner_traced.py --cases llama-1b-full,phi2-lora --out /tmp/traced.json
    python benchmarks/planner_traced.py --list
    python benchmarks/planner_traced.py --quick                  # CPU: each case on a tiny config, traces only
    python benchmarks/planner_traced.py --render a.json b.json --out results.md   # one table from several runs
    python benchmarks/planner_traced.py --recommend --cases phi2-lora --budget-gib 40   # run recommendations
    python benchmarks/planner_traced.py --recommend --quick      # CPU: the whole --recommend path, tiny configs

--recommend (planner_recommend.py): the traced tier's recommendation for each case under each budget (--budget-gib
cards, and with --card the card here) run for real in the HF Trainer (trainer_loop.py), and the same at a small
micro-batch, with a verdict per recommendation; results as JSON after each case and a markdown table beside it.

--render merges runs case by case, a later file's tier replacing an earlier one's (e.g. a CPU run of the traces
after a fix beside the GPU's measurements), and recomputes the errors against the measured tier.

A time budget (--budget, seconds, default 360) stops starting new cases once spent; skipped cases are listed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import transformers as T

from gpuopt_tui.core.planner.estimate import estimate
from gpuopt_tui.core.planner.measure import probe_request, run_probe
from gpuopt_tui.core.planner.model_spec import SUPPORTED, spec_from_config
from gpuopt_tui.core.planner.traced import traced_estimate
from gpuopt_tui.core.planner.train_setup import TrainSetup
from gpuopt_tui.jobs.plantrace import trace

GIB = 1024**3
HF = TrainSetup(loop="hf")  # bf16 autocast, AdamW, the HF Trainer's loop


@dataclass(frozen=True)
class Case:
    name: str
    config: Callable[[], T.PretrainedConfig]
    task: str
    setup: TrainSetup


def _lora(setup: TrainSetup, targets: tuple[str, ...] = ("all-linear",), rank: int = 16) -> TrainSetup:
    return replace(setup, trainable="lora", lora_targets=targets, lora_rank=rank)


def _llama_1b() -> T.PretrainedConfig:  # Llama-3.2-1B shapes
    return T.LlamaConfig(
        vocab_size=128256, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=8192, tie_word_embeddings=True, max_position_embeddings=4096,
    )  # fmt: skip


CASES = (
    Case(  # Llama-3.2-1B shapes
        "llama-1b-full",
        _llama_1b,
        "causal_lm",
        replace(HF, seq_len=1024, micro_batch=8),
    ),
    Case(  # GPT-2 small
        "gpt2-full-b16",
        lambda: T.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "causal_lm",
        replace(HF, seq_len=1024, micro_batch=16),
    ),
    Case(  # BERT-base classification
        "bert-base-cls",
        lambda: T.BertConfig(),
        "classification",
        replace(HF, seq_len=512, micro_batch=32),
    ),
    Case(  # Gemma-2B shapes, full fine-tune with gradient checkpointing
        "gemma-2b-full-ckpt",
        lambda: T.GemmaConfig(
            vocab_size=256000, hidden_size=2048, num_hidden_layers=18, num_attention_heads=8, num_key_value_heads=1,
            head_dim=256, intermediate_size=16384,
        ),
        "causal_lm",
        replace(HF, seq_len=1024, micro_batch=4, gradient_checkpointing=True),
    ),
    Case(  # Phi-2 shapes, LoRA on every linear layer
        "phi2-lora",
        lambda: T.PhiConfig(
            vocab_size=51200, hidden_size=2560, num_hidden_layers=32, num_attention_heads=32,
            intermediate_size=10240, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
        ),
        "causal_lm",
        _lora(replace(HF, seq_len=1024, micro_batch=4)),
    ),
    Case(  # Pythia-410M shapes
        "pythia-410m-full",
        lambda: T.GPTNeoXConfig(
            vocab_size=50304, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
            intermediate_size=4096,
        ),
        "causal_lm",
        replace(HF, seq_len=1024, micro_batch=8),
    ),
    Case(  # OPT-350M shapes
        "opt-350m-full",
        lambda: T.OPTConfig(
            vocab_size=50272, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, ffn_dim=4096,
            word_embed_proj_dim=512, dropout=0.0, attention_dropout=0.0,
        ),
        "causal_lm",
        replace(HF, seq_len=1024, micro_batch=8),
    ),
    Case(  # Falcon-RW-1B-like shapes (multi-query attention off), LoRA
        "falcon-1b-lora-ckpt",
        lambda: T.FalconConfig(
            vocab_size=50304, hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
            hidden_dropout=0.0, attention_dropout=0.0,
        ),
        "causal_lm",
        _lora(replace(HF, seq_len=1024, micro_batch=8, gradient_checkpointing=True)),
    ),
    Case(  # Phi-3-mini shapes (bf16 LoRA, the usual fine-tune)
        "phi3-mini-lora",
        lambda: T.Phi3Config(
            vocab_size=32064, hidden_size=3072, num_hidden_layers=32, num_attention_heads=32,
            intermediate_size=8192, pad_token_id=0,
        ),
        "causal_lm",
        _lora(replace(HF, seq_len=1024, micro_batch=4)),
    ),
    Case(  # T5-small (T5Config's defaults), encoder-decoder
        "t5-small-full",
        lambda: T.T5Config(dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0),
        "causal_lm",
        replace(HF, seq_len=512, micro_batch=16),
    ),
    Case(  # ModernBERT-base classification
        "modernbert-base-cls",
        lambda: T.ModernBertConfig(
            vocab_size=50368, hidden_size=768, num_hidden_layers=22, num_attention_heads=12,
            intermediate_size=1152, pad_token_id=50283,
        ),
        "classification",
        replace(HF, seq_len=512, micro_batch=32),
    ),
    Case(  # Mixtral shapes, scaled down (MoE routing)
        "mixtral-small-moe",
        lambda: T.MixtralConfig(
            vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
            intermediate_size=3584, num_local_experts=8, num_experts_per_tok=2,
        ),
        "causal_lm",
        replace(HF, seq_len=1024, micro_batch=4),
    ),
    Case(  # DeBERTa-v3-base shapes classification (disentangled relative attention)
        "deberta-v3-base-cls",
        lambda: T.DebertaV2Config(
            vocab_size=128100, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
            relative_attention=True, position_buckets=256, norm_rel_ebd="layer_norm", share_att_key=True,
            pos_att_type=["p2c", "c2p"], max_relative_positions=-1, position_biased_input=False,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        ),
        "classification",
        replace(HF, seq_len=512, micro_batch=16),
    ),
    Case(  # Gemma-2-2B shapes (logit soft-capping, sliding-window layers), LoRA with checkpointing
        "gemma2-2b-lora-ckpt",
        lambda: T.Gemma2Config(
            vocab_size=256000, hidden_size=2304, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
            head_dim=256, intermediate_size=9216, sliding_window=4096,
        ),
        "causal_lm",
        _lora(replace(HF, seq_len=1024, micro_batch=8, gradient_checkpointing=True)),
    ),
    Case(  # Llama-3.2-1B shapes at a small batch (the recommended one is llama-1b-full's)
        "llama-1b-full-b1",
        _llama_1b,
        "causal_lm",
        replace(HF, seq_len=1024, micro_batch=1),
    ),
)  # fmt: skip

# --quick: every case on a tiny config of its family (the sizes below, under whichever names the family's config
# uses; its other settings kept) at sequence length 64 and micro-batch 2; traces only
TINY = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "word_embed_proj_dim"), 64),
    **dict.fromkeys(("intermediate_size", "n_inner", "ffn_dim", "d_ff"), 128),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads"), 4),
    **dict.fromkeys(("head_dim", "d_kv"), 16),
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "vocab_size": 256,
}


def tiny(case: Case) -> Case:
    def config() -> T.PretrainedConfig:
        full = case.config()
        settings = {k: v for k, v in full.to_dict().items() if k != "layer_types"}  # one a layer: rebuilt
        tokens = [v for k, v in settings.items() if k.endswith("token_id") and isinstance(v, int)]
        sizes = {**TINY, "vocab_size": max(TINY["vocab_size"], *(t + 1 for t in tokens))}  # holding its special ids
        return type(full).from_dict({**settings, **{k: v for k, v in sizes.items() if settings.get(k)}})

    return Case(case.name, config, case.task, replace(case.setup, seq_len=64, micro_batch=2))


def _traced(config: dict[str, Any], case: Case, device: str) -> dict[str, Any]:
    request = {**probe_request(config, case.task, case.setup), "trace_device": device}
    result = trace(request)
    if result.get("error"):
        return {"error": result["error"], "seconds": result.get("seconds")}
    est = traced_estimate(result, case.task, case.setup)
    return {
        "allocated": est.allocated,
        "reserved": est.reserved,
        "phase": est.phase,
        "seconds": round(est.seconds, 2),
        "components": result["components"],
        "modules": result["activations_by_module"][:6],
    }


def _measured(config: dict[str, Any], case: Case) -> dict[str, Any]:
    r = run_probe(probe_request(config, case.task, case.setup, "cuda:0", steps=2, warmup=1), timeout=240)
    if r.error or r.oom:
        return {"error": r.error or "out of memory"}
    return {
        "allocated": r.max_allocated,
        "reserved": r.max_reserved,
        "context": r.context,
        "retries": r.num_alloc_retries,
        "seconds": round(r.seconds, 1),
    }


def _closed(config: dict[str, Any], case: Case) -> dict[str, Any] | None:
    if config.get("model_type") not in SUPPORTED:
        return None
    est = estimate(spec_from_config(config, case.name, case.task), case.setup)
    return {"allocated": est.allocated, "reserved": est.reserved, "phase": est.phase}


def _errors(row: dict[str, Any]) -> None:
    truth = row.get("measured") or {}
    if "allocated" not in truth:
        return
    for key in ("closed", *(k for k in row if k.startswith("traced_"))):
        tier = row.get(key) or {}
        for what in ("allocated", "reserved"):
            if what in tier:
                tier[f"{what}_error"] = round(tier[what] / truth[what] - 1, 4)


def run_case(case: Case, devices: list[str], measure: bool) -> dict[str, Any]:
    config = case.config().to_dict()
    row: dict[str, Any] = {"case": case.name, "model_type": config["model_type"], "task": case.task}
    row["setup"] = {k: v for k, v in vars(case.setup).items()}
    for device in devices:
        row[f"traced_{device}"] = _traced(config, case, device)
    row["closed"] = _closed(config, case)
    if measure:
        row["measured"] = _measured(config, case)
    _errors(row)
    return row


def _summary(rows: list[dict[str, Any]]) -> str:
    lines = ["case | tier | allocated GiB | error | reserved GiB | error | seconds"]
    for row in rows:
        for key in ("measured", "closed", *(k for k in row if k.startswith("traced_"))):
            tier = row.get(key)
            if not tier:
                continue
            if "error" in tier:
                lines.append(f"{row['case']} | {key} | failed: {tier['error'][:140]}")
                continue
            lines.append(
                f"{row['case']} | {key} | {tier['allocated'] / GIB:.2f} | {tier.get('allocated_error', '')} | "
                f"{tier['reserved'] / GIB:.2f} | {tier.get('reserved_error', '')} | {tier.get('seconds', '')}"
            )
    return "\n".join(lines)


def _merged(files: list[Path]) -> tuple[list[dict[str, Any]], list[str]]:
    """The cases of `files` merged (later tiers win), and a line per file saying what it contributed."""
    rows: dict[str, dict[str, Any]] = {}
    sources = []
    for path in files:
        data = json.loads(path.read_text())
        tiers: set[str] = set()
        for row in data["rows"]:
            merged = rows.setdefault(row["case"], {})
            for key, value in row.items():
                if value is not None:
                    merged[key] = value
            tiers |= {k for k in row if k in ("measured", "closed") or k.startswith("traced_")}
        gpu = data.get("gpu") or "no GPU"
        sources.append(f"`{path.name}`: {data['date']}, {gpu}, torch {data['torch']}, transformers "
                       f"{data['transformers']}; {len(data['rows'])} cases ({', '.join(sorted(tiers))})")  # fmt: skip
    for row in rows.values():
        _errors(row)
    return list(rows.values()), sources


def render(files: list[Path]) -> str:
    rows, sources = _merged(files)

    def pct(tier: dict[str, Any] | None, what: str) -> str:
        error = (tier or {}).get(f"{what}_error")
        return "—" if error is None else f"{error * 100:+.1f}%"

    lines = [
        "# The traced planner tier against the real training step",
        "",
        *(f"- source {s}" for s in sources),
        f"- command: `python benchmarks/planner_traced.py --render {' '.join(p.name for p in files)}`",
        "- errors: predicted / measured - 1; measured = max_memory_allocated / max_memory_reserved over 2 steps after"
        " a warm-up, in a fresh process on the GPU; traced_cpu = fake tensors on the CPU (the planner on a machine"
        " without a GPU), traced_cuda = fake CUDA tensors; closed = the closed form where it covers the family",
        "",
        "| case | setup | measured alloc / reserved GiB | traced CPU alloc / res | traced CUDA alloc / res "
        "| closed alloc / res | trace s (CPU) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        m, setup = row.get("measured") or {}, row["setup"]
        trained = setup["trainable"] + (f" r{setup['lora_rank']}" if setup["trainable"] == "lora" else "")
        ckpt = ", checkpointing" if setup["gradient_checkpointing"] else ""
        what = f"{setup['precision']}, {trained}{ckpt}, seq {setup['seq_len']} x {setup['micro_batch']}"
        measured = f"{m['allocated'] / GIB:.2f} / {m['reserved'] / GIB:.2f}" if "allocated" in m else "—"
        cells = [f"{pct(row.get(t), 'allocated')} / {pct(row.get(t), 'reserved')}"
                 for t in ("traced_cpu", "traced_cuda", "closed")]  # fmt: skip
        seconds = (row.get("traced_cpu") or {}).get("seconds", "—")
        lines.append(f"| {row['case']} | {what} | {measured} | {' | '.join(cells)} | {seconds} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny configs on the CPU, traces only")
    parser.add_argument("--devices", default="cpu,cuda", help="devices the fake tensors live on (cpu, cuda)")
    parser.add_argument("--budget", type=float, default=360.0, help="seconds after which no new case starts")
    parser.add_argument("--out", help="results JSON (default: $OUT/planner_traced.json or benchmarks/results/)")
    parser.add_argument("--render", type=Path, nargs="+", help="results JSON files to merge into a markdown --out")
    recommend = parser.add_argument_group("--recommend: the traced recommendation run in the HF Trainer")
    recommend.add_argument("--recommend", action="store_true", help="run each case's recommendation for real")
    recommend.add_argument(
        "--budget-gib", type=float, nargs="+", default=[40.0], help="cards to plan for, GiB (`plan --gpu-memory`)"
    )
    recommend.add_argument(
        "--card", action=argparse.BooleanOptionalAction, default=True, help="also plan for the card here (NVML)"
    )
    recommend.add_argument(
        "--effective-batch", type=int, default=64, help="effective batch to keep (0: the case's micro-batch)"
    )
    recommend.add_argument("--small-batch", type=int, default=1, help="the small micro-batch run beside")
    recommend.add_argument("--steps", type=int, default=4, help="optimizer steps of each Trainer run")
    recommend.add_argument(
        "--plan-jobs", type=int, default=1, help="plan every case first, this many at a time (1: each before its runs)"
    )
    args = parser.parse_args(argv)
    if args.render:
        text = render(args.render)
        if args.out:
            Path(args.out).write_text(text)
        else:
            print(text)
        return 0
    cases = tuple(map(tiny, CASES)) if args.quick else CASES
    if args.list:
        print("\n".join(c.name for c in cases))
        return 0
    if args.cases:
        by_name = {c.name: c for c in cases}  # in the order given
        cases = tuple(by_name[name] for name in args.cases.split(",") if name in by_name)
    if args.recommend:
        from planner_recommend import recommend_all

        return recommend_all(cases, args)
    cuda = torch.cuda.is_available()
    devices = [d for d in args.devices.split(",") if d == "cpu" or (d == "cuda" and cuda)]
    default_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out = Path(args.out) if args.out else default_dir / "planner_traced.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "torch": torch.__version__,
        "transformers": T.__version__,
        "devices": devices,
    }
    for case in cases:
        if time.perf_counter() - started > args.budget:
            skipped.append(case.name)
            continue
        print(f"{case.name} ...", flush=True)
        rows.append(run_case(case, devices, measure=cuda and not args.quick))
        # written after every case, so a run cut short still leaves its results
        out.write_text(json.dumps({**meta, "rows": rows, "skipped": skipped}, indent=2))
    out.write_text(json.dumps({**meta, "rows": rows, "skipped": skipped}, indent=2))
    print(_summary(rows))
    print(f"{len(rows)} cases in {time.perf_counter() - started:.0f} s; skipped: {', '.join(skipped) or 'none'}")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
