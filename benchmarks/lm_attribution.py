"""Causal LM attribution on a 1B-class decoder: our engine against Captum's LLMGradientAttribution, side by side.

The model is built from a config of a public checkpoint's shapes (--shape; random weights, initializer_range of the
config: no download), with a word-level tokenizer of numbered words built here (BOS before each prompt, [PAD] = 0).
Prompts of --min-prompt to --max-prompt random words; the completion is the prompt's last --completion words
(a copy task; --words distinct words). With --train-steps the model first learns the task (AdamW, bf16 autocast,
completion-only loss; stopping early at --target-loss or after --train-seconds) so that the completion's
log-probability depends on the prompt as a trained model's does: on random weights it barely moves between the
prompt and the baseline, and reduced precision's rounding swamps the change integrated. The
attributed output is the log-probability of the completion given the prompt (teacher forcing), the baseline [PAD]
at the prompt's content tokens (BOS kept), as `gpuopt-tui run` does for a causal LM.

Rows:
- ours: n_steps = "auto" at --tolerance with the defaults (fp16 weights, full-precision fallback), batches of
  --batch in length order (longest first), over --samples prompts; the whole completion's log-probability;
- ours, per completion token (per_target_token: a [completion, prompt] matrix), over --per-token-samples prompts;
- Captum's LLMGradientAttribution over LayerIntegratedGradients on the input embeddings, as its tutorial writes it
  (one prompt at a time, 50 Gauss-Legendre steps, the model in bf16), over the --audit prompts: it computes the
  per-token matrix, and the whole completion's scores as its sum;
- the reference: --reference-steps fixed Gauss-Legendre steps in strict fp32 (no TF32) on the --audit prompts
  (spread over the lengths), checked against half as many steps (its own convergence, reported).
Error of a row, per audited prompt: max |a - b| / max |b| over the prompt's token scores (BOS left out). A silent
miss is an audited prompt that our run reports within the tolerance whose error exceeds it.

    python benchmarks/lm_attribution.py --out benchmarks/results/lm_attribution_H200.md     # GPU
    python benchmarks/lm_attribution.py --quick                                            # CPU: checks the script
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ig_bench import _version, device_name, sync
from benchmarks.ig_conformance import MEMORY_FRACTION, engine_row
from gpuopt_tui.jobs.attribution.check import relative_difference
from gpuopt_tui.jobs.completion_data import COMPLETIONS, per_token_rows
from gpuopt_tui.jobs.data import TextDataset, batches, length_sorted_order
from gpuopt_tui.jobs.models.causal_lm import CausalLMAdapter

SPECIAL = ["<pad>", "<unk>", "<s>", "</s>"]
PAD, BOS = 0, 2
SHAPES: dict[str, dict[str, Any]] = {  # public checkpoints' shapes (config.json figures)
    "llama-1b": {  # Llama-3.2-1B
        "class": "LlamaConfig", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True,
        "rope_theta": 500000.0, "max_position_embeddings": 2048,
    },
    "qwen-1.5b": {  # Qwen2.5-1.5B
        "class": "Qwen2Config", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
        "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
        "rope_theta": 1000000.0, "max_position_embeddings": 2048,
    },
    "mistral-7b": {  # Mistral-7B-v0.1 (built in fp32: 29 GB of weights; too large for --train-steps' AdamW on one card)
        "class": "MistralConfig", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
    },
    "tiny": {  # --quick: the script's plumbing on the CPU
        "class": "LlamaConfig", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096, "max_position_embeddings": 1024,
    },
}  # fmt: skip


def build_model(shape: str, device: torch.device) -> torch.nn.Module:
    fields = dict(SHAPES[shape])
    config = getattr(transformers, fields.pop("class"))(**fields, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=3)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.eval().requires_grad_(False)


def word_tokenizer(n_words: int) -> Any:
    """Words w0..w{n-1} after the special tokens, one id each; BOS written before a text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {word: i for i, word in enumerate([*SPECIAL, *(f"w{i}" for i in range(n_words))])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def texts(n: int, low: int, high: int, n_words: int, gen: torch.Generator) -> list[str]:
    lengths = torch.randint(low, high + 1, (n,), generator=gen).tolist()
    return [" ".join(f"w{i}" for i in torch.randint(0, n_words, (k,), generator=gen).tolist()) for k in lengths]


def copy_task(
    n: int, args: argparse.Namespace, n_words: int, gen: torch.Generator, longest: int = 0
) -> tuple[list[str], list[str]]:
    """Prompts of random words (of --min-prompt to `longest` or --max-prompt words) and, as completions, each
    prompt's last --completion words."""
    high = longest or args.max_prompt
    prompts = texts(n, min(args.min_prompt, high), high, n_words, gen)
    return prompts, [" ".join(p.split()[-args.completion :]) for p in prompts]


def train(adapter: CausalLMAdapter, args: argparse.Namespace, n_words: int) -> dict[str, float]:
    """Up to --train-steps AdamW steps on the copy task (fresh prompts each step), stopping early once the mean loss
    of the last 10 steps is below --target-loss or after --train-seconds; the steps, the last loss, the seconds."""
    model, device = adapter.model, adapter.device
    model.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    gen, start, losses = torch.Generator().manual_seed(7), time.perf_counter(), [float("nan")]
    step = 0
    for step in range(args.train_steps):
        for group in optimizer.param_groups:  # linear warm-up over the first tenth
            group["lr"] = args.lr * min(1.0, (step + 1) / max(1, args.train_steps // 10))
        batch = {
            k: v.to(device)
            for k, v in dataset(
                adapter, *copy_task(args.train_batch, args, n_words, gen, args.train_max_prompt)
            ).tensors.items()
        }
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            loss = adapter.loss_per_example(batch).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == args.train_steps - 1:
            print(f"    train step {step}: loss {losses[-1]:.3f}", flush=True)
        recent = losses[-10:]
        if (len(losses) > 10 and sum(recent) / len(recent) < args.target_loss) or (
            args.train_seconds and time.perf_counter() - start > args.train_seconds
        ):
            print(f"    stopped after step {step}: loss {losses[-1]:.3f}", flush=True)
            break
    model.eval().requires_grad_(False)
    del optimizer
    return {"steps": step + 1, "loss": losses[-1], "seconds": time.perf_counter() - start}


def dataset(adapter: CausalLMAdapter, prompts: list[str], completions: list[str]) -> TextDataset:
    tensors = adapter.tokenize(prompts, 4096) | adapter.completions(completions, 4096)
    tensors["target_position"] = torch.full((len(prompts),), -1)
    return TextDataset(tensors, prompts, dict(adapter.token_fields), "benchmark", {COMPLETIONS: completions})


def on_device(ds: TextDataset, batch: int, device: torch.device) -> list[dict[str, Tensor]]:
    return [{k: v.to(device) for k, v in b.items()} for _, b in batches(ds, batch, length_sorted_order(ds))]


def prompt_scores(row: dict[str, Any], ds: TextDataset) -> list[Tensor]:
    """Each prompt's token scores from an engine row over `on_device(ds, ...)` (length order), BOS left out, in the
    dataset's order."""
    lengths = ds.lengths()
    out: list[Tensor] = [torch.zeros(0)] * len(ds)
    for k, i in enumerate(length_sorted_order(ds)):
        out[i] = row["scores"][k, 1 : int(lengths[i])].double().cpu()
    return out


def captum_rows(
    model: torch.nn.Module, tokenizer: Any, prompts: list[str], completions: list[str], device: torch.device
) -> dict[str, Any]:
    from captum.attr import LayerIntegratedGradients, LLMGradientAttribution, TextTokenInput

    lig = LayerIntegratedGradients(model, model.get_input_embeddings())
    llm_attr = LLMGradientAttribution(lig, tokenizer)
    seq, token = [], []

    def one(prompt: str, completion: str) -> Any:
        return llm_attr.attribute(TextTokenInput(prompt, tokenizer, skip_tokens=[BOS]), target=completion)

    one(prompts[-1], completions[-1])  # warm-up
    sync(device)
    start = time.perf_counter()
    for prompt, completion in zip(prompts, completions, strict=True):
        result = one(prompt, completion)
        seq.append(result.seq_attr.double().cpu())
        token.append(result.token_attr.double().cpu())
    sync(device)
    return {"seconds": time.perf_counter() - start, "scores": seq, "matrices": token}


def spread(order: list[int], k: int) -> list[int]:
    """`k` of `order` (the prompts, longest first) spread evenly over it, the longest and the shortest included."""
    return [order[round(i * (len(order) - 1) / max(1, k - 1))] for i in range(k)]


def errors(rows: list[Tensor], reference: list[Tensor]) -> Tensor:
    return torch.stack([relative_difference(a[None], b[None])[0] for a, b in zip(rows, reference, strict=True)])


def measure(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The rows in order of what matters most if the run is cut short (each row's figures saved as it ends, to
    --out's .pt): our rate, Captum's, the reference, the per-token rate."""
    model = build_model(args.shape, device)
    n_words = args.words
    tokenizer = word_tokenizer(n_words)
    adapter = CausalLMAdapter(args.shape, model, tokenizer, device)
    trained = train(adapter, args, n_words) if args.train_steps else None
    prompts, completions = copy_task(args.samples, args, n_words, torch.Generator().manual_seed(1))
    ds = dataset(adapter, prompts, completions)
    print(f"{adapter.describe()}; {len(ds)} prompts", flush=True)
    order = length_sorted_order(ds)
    audit = spread(order, args.audit)
    audit_ds, saved = ds.subset(audit), {"audit": audit}

    def save(name: str, value: Any) -> None:
        saved[name] = value
        if args.out:
            torch.save(saved, args.out.with_suffix(".pt"))

    auto = {"n_steps": "auto", "tolerance": args.tolerance, "batch_size": args.batch, "baseline": "pad"}
    ours = engine_row(adapter, on_device(ds, args.batch, device), **auto)
    save("ours", ours)
    captum = None
    if not args.skip_captum:
        bf16 = copy.deepcopy(model).to(torch.bfloat16)
        captum = captum_rows(bf16, tokenizer, [prompts[i] for i in audit], [completions[i] for i in audit], device)
        del bf16
        print(f"    Captum: {captum['seconds']:.1f} s for {len(audit)} prompts", flush=True)
        save("captum", captum)
    strict = {"use_amp": False, "tf32": False, "batch_size": args.batch, "baseline": "pad"}
    refs = {}
    for steps in (args.reference_steps, args.reference_steps // 2):
        row = engine_row(adapter, on_device(audit_ds, args.batch, device), n_steps=steps, **strict)
        refs[steps] = prompt_scores(row, audit_ds)
        save(f"reference_{steps}", refs[steps])
    per_token_prompts = spread(order, args.per_token_samples)  # as the audited prompts, over the lengths
    per_token_ds = per_token_rows(ds.subset(per_token_prompts))
    per_token = engine_row(adapter, on_device(per_token_ds, args.batch, device), **auto)
    reference = refs[args.reference_steps]
    ours_scores = prompt_scores(ours, ds)  # every prompt's, once
    err = errors([ours_scores[i] for i in audit], reference)
    within = ours["within"][[order.index(i) for i in audit]].bool()
    entries = [
        {"row": f"reference: {args.reference_steps // 2} GL steps, strict fp32 (against {args.reference_steps})",
         "err": errors(refs[args.reference_steps // 2], reference)},
        {"row": f"ours: auto {args.tolerance:g}, defaults", "samples": len(ds), "seconds": ours["seconds"], "err": err,
         "mean_steps": float(ours["steps"].double().mean()), "full_precision": int((ours["fallback"] > 0).sum()),
         "reported_within": int(within.sum()), "silent_misses": int((within & (err > args.tolerance)).sum())},
        {"row": f"ours: auto {args.tolerance:g}, defaults, per completion token ([completion, prompt] matrix)",
         "samples": args.per_token_samples, "seconds": per_token["seconds"],
         "mean_steps": float(per_token["steps"].double().sum()) / args.per_token_samples},
    ]  # fmt: skip
    if captum is not None:
        row = "Captum LLMGradientAttribution (LIG, 50 GL steps, bf16 model, one prompt at a time)"
        entries.append({"row": row, "samples": len(audit), "seconds": captum["seconds"],
                        "err": errors(captum["scores"], reference), "mean_steps": 50.0 * args.completion})  # fmt: skip
    return {"model": adapter.describe(), "entries": entries, "audit": len(audit), "trained": trained}


def render(meta: dict[str, Any], result: dict[str, Any]) -> str:
    lines = [
        "# Causal LM attribution: ours against Captum's LLMGradientAttribution",
        "",
        f"- date: {meta['date']}; device: {meta['device']}; torch {meta['torch']}, transformers "
        f"{meta['transformers']}, captum {meta['captum']}",
        f"- command: `{meta['command']}`",
        f"- model: {result['model']} ({meta['shape']} shapes, {_weights(result['trained'])}); prompts of "
        f"{meta['min_prompt']}-{meta['max_prompt']} words (of {meta['words']:,}) + BOS, completions = their last {meta['completion']} words; "
        "[PAD] baseline, BOS kept",
        f"- error: per audited prompt ({result['audit']}, spread over the lengths), max |a - b| / max |b| against "
        f"the reference; samples/s: prompts per second of the timed loop (after a warm-up)",
        *([f"- note: {meta['note']}"] if meta.get("note") else []),
        "",
        "| row | prompts | samples/s | steps per prompt (all its rows) | error median | error max | full precision "
        "| reported within / silent misses |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for e in result["entries"]:
        rate = f"{e['samples'] / e['seconds']:.2f}" if "seconds" in e else ""
        err = e.get("err")
        med, mx = (f"{float(err.median()):.2e}", f"{float(err.max()):.2e}") if err is not None else ("", "")
        within = f"{e['reported_within']} / {e['silent_misses']}" if "silent_misses" in e else ""
        steps = f"{e['mean_steps']:.1f}" if "mean_steps" in e else ""
        lines.append(
            f"| {e['row']} | {e.get('samples', result['audit'])} | {rate} | {steps} | {med} | {mx} "
            f"| {e.get('full_precision', '')} | {within} |"
        )
    return "\n".join(lines) + "\n"


def _weights(trained: dict[str, float] | None) -> str:
    if trained is None:
        return "random weights"
    return f"trained on the copy task: {trained['steps']} steps, {trained['seconds']:.0f} s, last loss {trained['loss']:.3f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    p.add_argument("--samples", type=int, default=256, help="prompts of our whole-completion row")
    p.add_argument("--per-token-samples", type=int, default=16)
    p.add_argument("--audit", type=int, default=8, help="prompts checked against the reference (and run by Captum)")
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--completion", type=int, default=16)
    p.add_argument("--tolerance", type=float, default=1e-2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--reference-steps", type=int, default=256)
    p.add_argument("--train-steps", type=int, default=0, help="steps of the copy task before attributing")
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument(
        "--train-max-prompt",
        type=int,
        default=0,
        help="longest training prompt in words (0: --max-prompt); shorter "
        "prompts give more steps of the same copy task in the same time",
    )
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--target-loss", type=float, default=0.0, help="stop training once the loss is below this")
    p.add_argument("--train-seconds", type=float, default=0.0, help="stop training after this long (0: no cap)")
    p.add_argument("--words", type=int, default=30000, help="distinct words of the prompts (capped by the vocabulary)")
    p.add_argument("--memory-fraction", type=float, default=0.9)
    p.add_argument("--skip-captum", action="store_true")
    p.add_argument("--note", default="")
    p.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: checks the script")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.shape, args.samples, args.per_token_samples, args.audit = "tiny", 6, 2, 2
        args.min_prompt, args.max_prompt, args.completion, args.reference_steps = 6, 20, 3, 32
        args.train_steps = min(args.train_steps, 30)
    args.words = min(args.words, SHAPES[args.shape]["vocab_size"] - len(SPECIAL))
    return args


def run_meta(device: torch.device, package: str, args: argparse.Namespace, keys: tuple[str, ...]) -> dict[str, Any]:
    """A results file's header figures: date, card, versions (torch, transformers, `package`), command, `keys` of args."""
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device_name(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        package: _version(package),
        "command": shlex.join(["python", *sys.argv]),
        **{k: getattr(args, k) for k in keys},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    MEMORY_FRACTION[0] = args.memory_fraction
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    meta = run_meta(device, "captum", args, ("shape", "min_prompt", "max_prompt", "completion", "words", "note"))
    result = measure(args, device)
    text = render(meta, result)
    print(text)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
        raw = {**meta, **result, "entries": [_plain(e) for e in result["entries"]]}
        args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1), encoding="utf-8")
    return 0


def _plain(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.tolist() if isinstance(v, Tensor) else v) for k, v in entry.items()}


if __name__ == "__main__":
    raise SystemExit(main())
