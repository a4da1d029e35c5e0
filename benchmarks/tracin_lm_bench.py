"""TracIn on a 1B-class decoder with LoRA adapter checkpoints, through `gpuopt-tui run`: issue 35's goals, scaled down.

The base model is built from a config of a public checkpoint's shapes (--shape; random weights, as
lm_attribution.py builds it: no download) with lm_attribution.py's word-level tokenizer, and saved with it as a local
model directory (in --base-dtype, as a released checkpoint is) that the run loads through `model.path`. The data:
--tasks tasks, each with its own topic words and rule; a row is a prompt (a task marker word, then words of the
task's topic) and a completion (from the prompt's last word on, each word the one before shifted by the task's step), about --tokens tokens in all; a
share --flipped of the training rows has a completion made by another task's rule (wrong). Two query sets of
--queries rows each, drawn apart from the training rows and each other.

A LoRA adapter (r = --rank, alpha = r, on every Linear layer of the decoder, by peft) is trained --steps AdamW steps
on the training rows (completion-only loss, bf16 autocast on a GPU, linearly decaying learning rate) before each of
3 saved adapter directories; each checkpoint's learning rate is the one in effect when it was saved.

Rows (each logged and written to --out as it ends; a killed run keeps what finished):
- cold: `python -m gpuopt_tui run` on a TOML profile written here: factored projection (--projection x
  --projection per LoRA matrix) of the adapter's parameters (tracin.layers = "auto"), bf16 autocast, the training
  gradient cache on and empty, micro-batches of --batch. Wall time of the command, examples/s and tokens/s of its
  scoring (from its summary.json), peak GPU memory (torch's, from the run's progress events; NVML's device memory in
  use above the level before the command), the cache's size on disk and bytes per stored number;
- cached: the second query set, the same training rows and checkpoints: the training gradients come from the cache;
- exact: exact LoRA-gradient TracIn, computed here in strict fp32 (no TF32) one example at a time (the completion's
  mean token cross-entropy, tokens built with the tokenizer, no padding; sum over checkpoints of lr x dot product,
  the query gradients held and each training gradient dotted against them as it comes) on the first --exact-train
  training rows x the first --exact-queries queries of the first set; Spearman per query of the cold run's scores on
  that subset (read from its scores.safetensors; a small CLI run on the subset when the cold row is not run) against
  them, median and min, and top-10 overlap. Also reported: the share of each query's top-10 proponents of its own
  task, and the flipped rows' AUC by self-influence.
- dattri (with exact): dattri's LoGra on the same adapter checkpoints (tracin_lm_dattri.py) on the first
  --dattri-train training rows against the first query set: examples/s and tokens/s side by side with the cold
  row's, its peak GPU memory, and its agreement with the exact scores on the exact row's subset.

The 100k-example figures are extrapolations, linear in the number of training rows, from the rows measured here.

    python benchmarks/tracin_lm_bench.py --out benchmarks/results/tracin_lm_H200.md     # GPU (about 8 minutes)
    python benchmarks/tracin_lm_bench.py --quick                                      # CPU: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.lm_attribution import SHAPES, SPECIAL, build_model, dataset, run_meta, word_tokenizer
from benchmarks.tracin_lm_dattri import dattri_logra_scores
from gpuopt_tui.jobs.models.causal_lm import CausalLMAdapter
from gpuopt_tui.jobs.tracin.agreement import top_k_overlap
from gpuopt_tui.jobs.tracin.grad_cache import BASES
from gpuopt_tui.jobs.tracin.job import flipped_auc

ROWS = ("cold", "cached", "exact", "dattri")
META_ARGS = ("shape", "base_dtype", "train", "tokens", "queries", "tasks", "words", "flipped", "rank", "projection",
             "basis", "batch", "note")  # fmt: skip
GOAL_TRAIN = 100_000  # issue 35's training set
QUICK = {"shape": "tiny", "train": 64, "tokens": 40, "queries": 8, "rank": 8, "steps": 3, "train_batch": 4,
         "exact_train": 24, "exact_queries": 4, "projection": 4, "tasks": 4, "lr": 1e-3}  # fmt: skip


# --- data ---------------------------------------------------------------------------------------------------------
def make_rows(n: int, args: argparse.Namespace, n_words: int, seed: int, flipped: float) -> list[dict[str, Any]]:
    """Prompt + completion rows of --tasks tasks. Words w0..w{tasks-1} mark the task; the rest are cut into one
    topic per task. A prompt is its task's marker and words of its topic; the completion continues from the prompt's
    last word by the task's rule (each word the one before shifted by the task's step within the topic), or, in a
    `flipped` share of rows, by another task's."""
    gen = torch.Generator().manual_seed(seed)
    topic = (n_words - args.tasks) // args.tasks
    completion = max(2, args.tokens // 8)
    longest = args.tokens - completion - 2  # BOS and the marker
    rows = []
    for i in range(n):
        task = int(torch.randint(args.tasks, (1,), generator=gen))
        words = torch.randint(
            topic, (int(torch.randint(longest * 3 // 4, longest + 1, (1,), generator=gen)),), generator=gen
        )
        is_flipped = i < round(flipped * n)  # the first rows, then shuffled into place below
        rule = (task + 1 + int(torch.randint(args.tasks - 1, (1,), generator=gen))) % args.tasks if is_flipped else task
        shifted = (words[-1] + (1 + 3 * rule) * torch.arange(1, completion + 1)) % topic
        base = args.tasks + task * topic
        rows.append({
            "prompt": " ".join([f"w{task}", *(f"w{base + int(w)}" for w in words)]),
            "completion": " ".join(f"w{base + int(w)}" for w in shifted),
            "task": task,
            "flipped": is_flipped,
        })  # fmt: skip
    order = torch.randperm(n, generator=gen).tolist()
    return [rows[k] for k in order]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


# --- model and adapter checkpoints -------------------------------------------------------------------------------
def save_base(model: torch.nn.Module, tokenizer: Any, folder: Path, dtype: torch.dtype) -> None:
    """Save the base model in `dtype` with its tokenizer; `model` keeps the saved weights (rounded to `dtype`), in
    fp32."""
    model.to(dtype).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model.float()


def train_step(
    adapter: CausalLMAdapter, optimizer: torch.optim.Optimizer, rows: list[dict[str, Any]], lr: float, size: int,
    gen: torch.Generator,
) -> float:  # fmt: skip
    """One optimizer step at `lr` on `size` rows drawn at random (bf16 autocast on a GPU); the loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    device = adapter.device
    chosen = [rows[int(i)] for i in torch.randint(len(rows), (size,), generator=gen)]
    ds = dataset(adapter, [r["prompt"] for r in chosen], [r["completion"] for r in chosen])
    batch = {k: v.to(device) for k, v in ds.tensors.items()}
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        loss = adapter.loss_per_example(batch).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def pretrain(model: torch.nn.Module, tokenizer: Any, rows: list[dict[str, Any]], args: argparse.Namespace) -> dict:
    """--pretrain-steps of full-parameter AdamW on the training rows (linear warm-up over a tenth, then linear
    decay from --pretrain-lr), so that the base model has learnt something of the tasks before the adapter is
    trained: a random model's gradients are nearly orthogonal, below what a projection resolves."""
    device = next(model.parameters()).device
    adapter = CausalLMAdapter("benchmark", model.requires_grad_(True), tokenizer, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.pretrain_lr, weight_decay=0.0)
    gen, total, warm = torch.Generator().manual_seed(4), args.pretrain_steps, max(1, args.pretrain_steps // 10)
    start, losses = time.perf_counter(), []
    model.train()
    for step in range(total):
        lr = args.pretrain_lr * min((step + 1) / warm, (total - step) / (total - warm + 1))
        losses.append(train_step(adapter, optimizer, rows, lr, args.train_batch, gen))
        if (step + 1) % max(1, total // 5) == 0:
            print(f"    pretraining step {step + 1}: loss {losses[-1]:.3f}", flush=True)
    model.eval().requires_grad_(False)
    del optimizer
    return {"steps": total, "first_loss": losses[0], "last_loss": losses[-1], "seconds": time.perf_counter() - start}


def train_adapters(
    model: torch.nn.Module, tokenizer: Any, rows: list[dict[str, Any]], args: argparse.Namespace, folder: Path
) -> tuple[torch.nn.Module, list[dict[str, Any]], dict[str, Any]]:
    """Wrap `model` in a LoRA adapter, train it and save 3 adapter directories: (the PEFT model, [{path, lr}],
    training figures)."""
    import peft

    config = peft.LoraConfig(r=args.rank, lora_alpha=args.rank, target_modules="all-linear", lora_dropout=0.0)
    model = peft.get_peft_model(model, config)
    device = next(model.parameters()).device
    adapter = CausalLMAdapter("benchmark", model, tokenizer, device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    gen, total = torch.Generator().manual_seed(5), 3 * args.steps
    checkpoints, losses, start = [], [], time.perf_counter()
    model.train()
    for step in range(total):
        lr = args.lr * (1 - 0.75 * step / total)
        losses.append(train_step(adapter, optimizer, rows, lr, args.train_batch, gen))
        if (step + 1) % args.steps == 0:
            path = folder / f"checkpoint-{step + 1}"
            model.save_pretrained(path)
            checkpoints.append({"path": str(path), "lr": lr})
            print(f"    step {step + 1}: loss {losses[-1]:.3f}; saved {path.name} (lr {lr:.3g})", flush=True)
    model.eval()
    del optimizer
    return model, checkpoints, {"steps": total, "first_loss": losses[0], "last_loss": losses[-1],
                                "seconds": time.perf_counter() - start}  # fmt: skip


# --- runs through the CLI -------------------------------------------------------------------------------------------
def write_profile(path: Path, args: argparse.Namespace, files: dict[str, Path], checkpoints: list[dict[str, Any]],
                  queries: Path, n_train: int = 0, n_test: int = 0, projection: int | None = None,
                  basis: str = "random") -> Path:  # fmt: skip
    """A TracIn profile as a user would write it for this setup (n_train, n_test: 0 = all rows; projection: None =
    --projection, 0 = exact gradients; basis: tracin.projection_basis)."""
    projection = args.projection if projection is None else projection
    listed = ",\n  ".join(f'{{ path = "{c["path"]}", lr = {c["lr"]!r} }}' for c in checkpoints)
    path.write_text(
        f"""kind = "tracin"
name = "{path.stem}"
description = "TracIn over LoRA adapter checkpoints of a {args.shape}-shaped decoder (benchmark)"

[run]
device = "{args.device}"

[model]
adapter = "hf"
path = "{files["model"]}"

[data]
source = "jsonl"
path = "{queries}"
text_field = "prompt"
target_field = "completion"
max_length = {args.tokens + 8}

[tracin]
train_path = "{files["train"]}"
checkpoints = [
  {listed},
]
n_train = {n_train}
n_test = {n_test}
layers = "auto"
method = "factored"
projection_in = {projection}
projection_out = {projection}
projection_basis = "{basis}"
train_cache = true
amp_dtype = "bf16"
batch_size = {args.batch}
top_k = 10
""",
        encoding="utf-8",
    )
    return path


class NvmlPeak:
    """The most device memory in use (NVML) above `baseline` while the block runs, sampled every 0.2 s; None without
    NVML or a GPU."""

    def __init__(self) -> None:
        self.peak: int | None = None
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(
                int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0)
            )
            self._used = lambda: int(pynvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        except Exception:
            self._used = None

    def __enter__(self) -> NvmlPeak:
        if self._used is not None:
            self.baseline = self._used()
            self.peak = 0
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak or 0, self._used() - self.baseline)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._used is not None:
            self._thread.join()


def cli_run(profile: Path, home: Path, log: Path) -> dict[str, Any]:
    """Run `python -m gpuopt_tui run PROFILE` with its data under `home`: wall seconds, NVML peak, the run's
    summary.json, its results folder and the peaks of its progress events."""
    path = [str(Path(__file__).resolve().parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "GPUOPT_TUI_HOME": str(home), "PYTHONPATH": os.pathsep.join(path)}
    env.pop("GPUOPT_TUI_RUNS_DIR", None)
    env.pop("GPUOPT_TUI_CACHE_DIR", None)
    before = set((home / "runs").glob("*")) if (home / "runs").is_dir() else set()
    command = [sys.executable, "-m", "gpuopt_tui", "run", str(profile)]
    with NvmlPeak() as nvml, log.open("w") as out:
        start = time.perf_counter()
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        wall = time.perf_counter() - start
    new = sorted(set((home / "runs").glob("*")) - before)
    if done.returncode != 0 or len(new) != 1:
        tail = log.read_text(errors="replace").splitlines()[-25:]
        raise SystemExit(
            f"`{shlex.join(command)}` failed (exit {done.returncode}); last lines of {log}:\n" + "\n".join(tail)
        )
    run = new[0]
    summary = json.loads((run / "results" / "summary.json").read_text())
    return {"wall": wall, "nvml_peak": nvml.peak, "summary": summary, "results": run / "results", "run": run,
            **event_peaks(run / "events.jsonl")}  # fmt: skip


def event_peaks(events: Path) -> dict[str, int | None]:
    """The largest torch figures (max_memory_allocated, memory_reserved) the run's progress events carry."""
    peak = reserved = None
    for line in events.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if "gpu_peak" in event:
            peak = max(peak or 0, int(event["gpu_peak"]))
            reserved = max(reserved or 0, int(event.get("gpu_reserved", 0)))
    return {"torch_peak": peak, "torch_reserved": reserved}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def _bound(row: dict[str, Any]) -> str:
    """ "<= " before the 100k time of a row that computed no training gradient (read them all from the cache)."""
    cache = row.get("train_cache") or {}
    return "<= " if cache.get("read") and not cache.get("computed") else ""


def run_row(name: str, cli: dict[str, Any], n_train: int, n_queries: int, cache: Path) -> dict[str, Any]:
    """A CLI row's figures, with the 100k extrapolation (linear in the training rows) and the cache's size. Fitting
    PCA directions and the stored directions are fixed costs (per checkpoint, not per row): outside the lines."""
    timing, summary = cli["summary"]["timing"], cli["summary"]
    scoring = timing.get("compute_seconds") or 0.0
    fitting = timing.get("projection_fit_seconds") or 0.0
    fixed = cli["wall"] - scoring + fitting
    stored = folder_bytes(cache)
    bases = sum(p.stat().st_size for p in cache.rglob(BASES)) if cache.is_dir() else 0
    numbers = n_train * len(summary["checkpoints"]) * summary["gradient_size"]
    return {
        "row": name, "train": n_train, "queries": n_queries, "wall": cli["wall"], "scoring_seconds": scoring,
        "fit_seconds": fitting,
        "examples_per_s": timing.get("train_examples_per_s"), "tokens_per_s": timing.get("train_tokens_per_s"),
        "batch": summary.get("final_batch_size"), "torch_peak": cli["torch_peak"], "torch_reserved": cli["torch_reserved"],
        "nvml_peak": cli["nvml_peak"], "train_cache": summary.get("train_cache"), "cache_bytes": stored,
        "bases_bytes": bases, "bytes_per_number": (stored - bases) / numbers if numbers else None,
        "gradient_size": summary["gradient_size"],
        "n_parameters": summary["n_parameters"], "parameter_tensors": len(summary["parameter_tensors"]),
        "excluded": len(summary.get("excluded_parameters") or []), "precision": summary["precision"],
        "extrapolated_seconds": fixed + (scoring - fitting) * GOAL_TRAIN / n_train,
        "extrapolated_cache_bytes": bases + (stored - bases) * GOAL_TRAIN / n_train, "run": str(cli["run"]),
    }  # fmt: skip


# --- exact reference ------------------------------------------------------------------------------------------------
def example_gradient(model: torch.nn.Module, params: list[Tensor], ids: Tensor, n_prompt: int) -> Tensor:
    """The gradient of the completion's mean token cross-entropy (tokens from `n_prompt` on) wrt `params`, flat.
    The logits are computed at the positions that predict a completion token only (and the last one, dropped)."""
    logits = model(input_ids=ids[None], logits_to_keep=len(ids) - n_prompt + 1).logits[0].float()
    loss = torch.nn.functional.cross_entropy(logits[:-1], ids[n_prompt:])
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])


def token_ids(tokenizer: Any, row: dict[str, Any], device: torch.device) -> tuple[Tensor, int]:
    prompt = tokenizer(row["prompt"])["input_ids"]  # with BOS, as the run tokenizes a prompt
    completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
    return torch.tensor(prompt + completion, device=device), len(prompt)


def exact_scores(
    model: torch.nn.Module, tokenizer: Any, checkpoints: list[dict[str, Any]], train: list[dict[str, Any]],
    queries: list[dict[str, Any]],
) -> Tensor:  # fmt: skip
    """([queries, train] sum over checkpoints of lr x <g_query, g_train>, fp32 gradients (float64 sums), streaming;
    the median |cosine| between query and training gradients at the first checkpoint)."""
    import peft
    from safetensors.torch import load_file

    device = next(model.parameters()).device
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    params = [p for p in model.parameters() if p.requires_grad]
    scores = torch.zeros(len(queries), len(train), dtype=torch.float64)
    cosines = torch.zeros(len(queries), len(train), dtype=torch.float64)
    try:
        for c, ckpt in enumerate(checkpoints):
            state = load_file(str(Path(ckpt["path"]) / "adapter_model.safetensors"))
            peft.set_peft_model_state_dict(model, {k: v.float() for k, v in state.items()})
            held = torch.stack([example_gradient(model, params, *token_ids(tokenizer, q, device)) for q in queries])
            for i, row in enumerate(train):
                g = example_gradient(model, params, *token_ids(tokenizer, row, device))
                dots = (held @ g).double().cpu()
                scores[:, i] += ckpt["lr"] * dots
                if c == 0:
                    cosines[:, i] = dots / (held.norm(dim=1).double().cpu() * g.norm().double().cpu())
            print(f"    exact: checkpoint {c + 1}/{len(checkpoints)} done", flush=True)
            del held
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return scores, float(cosines.abs().median())


def spearman_per_query(a: Tensor, b: Tensor) -> Tensor:
    """Spearman correlation of each row of a with the same row of b (ranks by position; continuous scores)."""
    ra, rb = (x.double().argsort(1).argsort(1).double() for x in (a, b))
    ra, rb = ra - ra.mean(1, keepdim=True), rb - rb.mean(1, keepdim=True)
    return (ra * rb).sum(1) / (ra.norm(dim=1) * rb.norm(dim=1))


def run_matrix(results: Path, n_train: int, n_queries: int) -> Tensor:
    """The run's scores of its first `n_queries` queries on training rows 0..n_train-1 (in that order)."""
    from safetensors.torch import load_file

    saved = load_file(str(results / "scores.safetensors"))
    column = {int(r): j for j, r in enumerate(saved["train_index"].tolist())}
    return saved["scores"][:n_queries, [column[i] for i in range(n_train)]].double()


def influence_sanity(results: Path, train: list[dict[str, Any]], queries: list[dict[str, Any]]) -> dict[str, Any]:
    """Share of each query's top-10 proponents of its own task, and the flipped rows' AUC by self-influence."""
    records = [json.loads(line) for line in (results / "influence.jsonl").read_text().splitlines()]
    same = [
        sum(train[p["index"]]["task"] == queries[r["index"]]["task"] for p in r["proponents"])
        / max(1, len(r["proponents"]))
        for r in records
    ]
    ranked = [json.loads(line) for line in (results / "self_influence.jsonl").read_text().splitlines()]
    rows = torch.tensor([r["index"] for r in ranked])
    auc = flipped_auc(torch.tensor([r["self_influence"] for r in ranked]), rows,
                      {i for i, row in enumerate(train) if row["flipped"]})  # fmt: skip
    return {"proponents_same_task": sum(same) / len(same), "flipped_auc": auc}


# --- the benchmark ------------------------------------------------------------------------------------------------
def measure(args: argparse.Namespace, device: torch.device, report: Any) -> None:
    work = args.work or Path(tempfile.mkdtemp(prefix="tracin-lm-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    home, cache = work / "home", work / "home" / "cache" / "tracin-gradients"
    n_words = args.words or min(30000, SHAPES[args.shape]["vocab_size"] - len(SPECIAL))
    train = make_rows(args.train, args, n_words, seed=1, flipped=args.flipped)
    sets = [make_rows(args.queries, args, n_words, seed=s, flipped=0.0) for s in (2, 3)]
    files = {"model": work / "model", "train": write_jsonl(work / "train.jsonl", train)}
    queries = [write_jsonl(work / f"queries_{k}.jsonl", rows) for k, rows in zip("ab", sets)]
    start = time.perf_counter()
    model = build_model(args.shape, device)
    tokenizer = word_tokenizer(n_words)
    pretrained = pretrain(model, tokenizer, train, args) if args.pretrain_steps else None
    save_base(model, tokenizer, files["model"], getattr(torch, args.base_dtype))
    model, checkpoints, trained = train_adapters(model, tokenizer, train, args, work / "adapters")
    report.meta["setup"] = {"seconds": time.perf_counter() - start, "pretraining": pretrained, "training": trained,
                            "checkpoints": checkpoints, "work": str(work)}  # fmt: skip
    report.save()
    model.to("cpu")  # the runs get the GPU to themselves
    if device.type == "cuda":
        torch.cuda.empty_cache()
    cold = None
    if "cold" in args.rows:
        shutil.rmtree(cache, ignore_errors=True)
        profile = write_profile(work / "tracin-lm-a.toml", args, files, checkpoints, queries[0], basis=args.basis)
        cold = cli_run(profile, home, work / "cold.log")
        report.add(run_row("cold: first query set, empty cache", cold, len(train), args.queries, cache)
                   | influence_sanity(cold["results"], train, sets[0]))  # fmt: skip
    if "cached" in args.rows:
        profile = write_profile(work / "tracin-lm-b.toml", args, files, checkpoints, queries[1], basis=args.basis)
        cached = cli_run(profile, home, work / "cached.log")
        from_cache = (cached["summary"].get("train_cache") or {}).get("read", 0) > 0
        name = (
            "cached: second query set, training gradients from the cache"
            if from_cache
            else "second query set: the cache was empty (no cold row), training gradients computed"
        )
        report.add(run_row(name, cached, len(train), args.queries, cache)
                   | influence_sanity(cached["results"], train, sets[1]))  # fmt: skip
    if "exact" in args.rows:
        for row in agreement(
            args, model.to(device), tokenizer, checkpoints, train, sets[0], files, queries, cold, work
        ):
            report.add(row)


def agreement(
    args: argparse.Namespace, model: torch.nn.Module, tokenizer: Any, checkpoints: list[dict[str, Any]],
    train: list[dict[str, Any]], queries: list[dict[str, Any]], files: dict[str, Path], query_files: list[Path],
    cold: dict[str, Any] | None, work: Path,
) -> list[dict[str, Any]]:  # fmt: skip
    """The exact rows: exact fp32 LoRA-gradient TracIn on the subset, against the run's scores at each projection of
    --exact-projections (the cold run's for --projection, else a small CLI run on the subset)."""
    n, q = min(args.exact_train, len(train)), min(args.exact_queries, len(queries))
    start = time.perf_counter()
    exact, cosine = exact_scores(model, tokenizer, checkpoints, train[:n], queries[:q])
    seconds = time.perf_counter() - start
    rows = []
    for size in args.exact_projections or [str(args.projection)]:
        k, basis = int(size.removesuffix("pca")), "pca" if size.endswith("pca") else "random"
        run, source = cold, "the cold run's score matrix"
        if run is None or k != args.projection or basis != args.basis:
            profile = write_profile(work / f"tracin-lm-subset-{size}.toml", args, files, checkpoints, query_files[0],
                                    n, q, projection=k, basis=basis)  # fmt: skip
            run, source = cli_run(profile, work / "home", work / f"subset-{size}.log"), "a CLI run on the subset"
        ours = run_matrix(run["results"], n, q)
        rho = spearman_per_query(ours, exact)
        rows.append({
            "row": f"exact: fp32 LoRA-gradient TracIn on {n} train x {q} queries against {k} x {k} {basis} "
            f"(ours from {source})",
            "train": n, "queries": q, "wall": seconds, "examples_per_s": n * len(checkpoints) / seconds,
            "spearman_median": float(rho.median()), "spearman_min": float(rho.min()),
            "spearman_mean": float(rho.mean()), "top10_overlap": top_k_overlap(ours, exact, 10),
            "cosine_median": cosine, "resolution": run["summary"]["gradient_size"] ** -0.5,
        })  # fmt: skip
    if "dattri" in args.rows:
        rows.append(dattri_row(args, model, tokenizer, checkpoints, train, queries, exact, cold))
    return rows


def dattri_row(
    args: argparse.Namespace, model: torch.nn.Module, tokenizer: Any, checkpoints: list[dict[str, Any]],
    train: list[dict[str, Any]], queries: list[dict[str, Any]], exact: Tensor, cold: dict[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    """dattri's LoGra on the first --dattri-train rows x the query set: its rate beside the cold run's, and its
    Spearman against `exact` (the first rows x the first queries)."""
    cpu = torch.device("cpu")
    rows = [token_ids(tokenizer, r, cpu) for r in train[: max(args.dattri_train, exact.shape[1])]]
    asked = [token_ids(tokenizer, q, cpu) for q in queries]
    got = dattri_logra_scores(model, tokenizer.pad_token_id, checkpoints, rows, asked, args.projection,
                              args.dattri_batch, args.dattri_fp32)  # fmt: skip
    theirs = got["scores"][: exact.shape[0], : exact.shape[1]]
    rho = spearman_per_query(theirs, exact)
    tokens = sum(len(ids) for ids, _ in rows)
    ours = (cold or {}).get("summary", {}).get("timing", {}).get("train_examples_per_s")
    return {
        "row": f"dattri {version('dattri')} LoGra ({got['settings']}) on {len(rows)} train x {len(queries)} queries",
        "dattri": True, "train": len(rows), "queries": len(queries), "wall": got["seconds"],
        "examples_per_s": len(rows) / got["seconds"], "tokens_per_s": tokens / got["seconds"],
        "torch_peak": got["peak"], "ours_examples_per_s": ours,
        "spearman_median": float(rho.median()), "spearman_min": float(rho.min()), "spearman_mean": float(rho.mean()),
        "top10_overlap": top_k_overlap(theirs, exact, 10),
    }  # fmt: skip


class Report:
    """The rows so far, printed as each ends and written to --out (markdown + JSON) each time."""

    def __init__(self, args: argparse.Namespace, meta: dict[str, Any]) -> None:
        self.args, self.meta, self.rows = args, meta, []

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        print(f"  {row['row']}: " + ", ".join(f"{k} {_fmt(v)}" for k, v in row.items() if k not in ("row", "run")),
              flush=True)  # fmt: skip
        self.save()

    def save(self) -> None:
        if self.args.out:
            self.args.out.write_text(render(self.meta, self.rows), encoding="utf-8")
            self.args.out.with_suffix(".json").write_text(json.dumps({**self.meta, "rows": self.rows}, indent=1))


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _rate(row: dict[str, Any], key: str) -> str:
    return "" if row.get(key) is None else f"{row[key]:,.0f}"


def _gib(v: float | None) -> str:
    return "" if v is None else f"{v / 2**30:.2f}"


def _base_weights(pretrained: dict[str, Any] | None) -> str:
    if not pretrained:
        return "random weights"
    return (f"random weights trained here ({pretrained['steps']} full-parameter AdamW steps on the training rows, "
            f"{pretrained['seconds']:.0f} s, loss {pretrained['first_loss']:.2f} -> {pretrained['last_loss']:.2f})")  # fmt: skip


def render(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    setup = meta.get("setup", {})
    trained = setup.get("training")
    lrs = ", ".join(f"{c['lr']:.3g}" for c in setup.get("checkpoints", []))
    lines = [
        "# TracIn on a 1B-class decoder with LoRA adapter checkpoints (issue 35, scaled down)",
        "",
        f"- date: {meta['date']}; device: {meta['device']}; torch {meta['torch']}, transformers {meta['transformers']}, "
        f"peft {meta['peft']}",
        f"- command: `{meta['command']}`",
        f"- model: {meta['shape']} shapes, {_base_weights(setup.get('pretraining'))} saved in {meta['base_dtype']}, "
        f"word-level tokenizer; LoRA r = "
        f"{meta['rank']} (alpha = r) on all Linear layers of the decoder, 3 adapter checkpoints "
        + (
            f"({trained['steps']} AdamW steps in all, {trained['seconds']:.0f} s, loss {trained['first_loss']:.2f} -> "
            f"{trained['last_loss']:.2f}; lrs {lrs})"
            if trained
            else ""
        ),
        f"- data: {meta['train']} training rows of about {meta['tokens']} tokens (prompt + completion; {meta['tasks']} "
        f"tasks, {meta['flipped']:.0%} with a wrong completion; "
        f"{meta.get('words') or 'min(30000, the vocabulary)'} words), query sets of {meta['queries']} rows",
        f"- run: `gpuopt-tui run` (method = factored, {meta['projection']} x {meta['projection']} per LoRA matrix, "
        f"projection_basis = {meta.get('basis', 'random')} in the cold and cached rows, "
        f"bf16 autocast on a GPU (fp32 on the CPU), train_cache = true, batch_size = {meta['batch']}); wall = the whole command (start-up, model "
        "load, query gradients, writing results); scoring = its summary's compute_seconds",
        "- scaled down: the 100k column is an extrapolation, linear in the training rows (fixed part + scoring x "
        f"100000 / {meta['train']}; fitting PCA directions and the stored directions are in the fixed part, out of "
        "scoring and bytes/number), not a measurement; for a row whose training gradients came from the cache an "
        "upper bound (<=): its scoring includes the queries' own gradients, which do not grow with the training rows",
        *([f"- note: {meta['note']}"] if meta.get("note") else []),
        "",
        "| row | train x queries | wall s | scoring s | train ex/s | tokens/s | micro-batch | torch peak alloc / "
        "reserved GiB | NVML peak GiB | cache GiB | bytes/number | 100k extrapolated: min, cache GiB |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        if "spearman_median" in r:
            continue
        lines.append(
            f"| {r['row']} | {r['train']} x {r['queries']} | {r['wall']:.1f} | {r['scoring_seconds']:.1f} "
            f"| {_rate(r, 'examples_per_s')} | {_rate(r, 'tokens_per_s')} | {r['batch'] or 'none (cache)'} | {_gib(r['torch_peak'])} / "
            f"{_gib(r['torch_reserved'])} | {_gib(r['nvml_peak'])} | {_gib(r['cache_bytes'])} | "
            f"{_fmt(r['bytes_per_number'])} | {_bound(r)}{r['extrapolated_seconds'] / 60:.1f}, {_gib(r['extrapolated_cache_bytes'])} |"
        )
    for r in rows:
        if "proponents_same_task" in r:
            lines.append(f"\n- {r['row']}: {r['parameter_tensors']} adapter tensors ({r['n_parameters']:,} numbers, "
                         f"{r['excluded']} left out), {r['gradient_size']:,} projected numbers per example and "
                         f"checkpoint; cache blocks {r['train_cache']}; top-10 proponents of the query's own task "
                         f"{r['proponents_same_task']:.2f} (chance {1 / meta['tasks']:.2f}); flipped rows' AUC by "
                         f"self-influence {_fmt(r['flipped_auc'])}")  # fmt: skip
            if r.get("fit_seconds") or r.get("bases_bytes"):
                lines.append(f"  PCA directions: {r.get('fit_seconds', 0):.1f} s of the scoring fitting them, "
                             f"{_gib(r.get('bases_bytes', 0))} GiB of them stored with the cache")  # fmt: skip
        if "dattri" in r:
            ratio = f"; ours (cold row) {r['ours_examples_per_s'] / r['examples_per_s']:.1f}x its rate" if r[
                "ours_examples_per_s"] else ""  # fmt: skip
            lines.append(f"\n- {r['row']}: {r['wall']:.1f} s, {r['examples_per_s']:.1f} train ex/s, "
                         f"{r['tokens_per_s']:.0f} tokens/s{ratio}; torch peak {_gib(r['torch_peak'])} GiB; against "
                         f"the exact rows: Spearman per query median {r['spearman_median']:.4f}, min "
                         f"{r['spearman_min']:.4f} (mean {r['spearman_mean']:.4f}); top-10 overlap "
                         f"{r['top10_overlap']:.3f}")  # fmt: skip
        elif "spearman_median" in r:
            lines.append(f"\n- {r['row']}: Spearman per query median {r['spearman_median']:.4f}, min "
                         f"{r['spearman_min']:.4f} (mean {r['spearman_mean']:.4f}); top-10 overlap "
                         f"{r['top10_overlap']:.3f}; the reference took {r['wall']:.0f} s; exact query-training "
                         f"gradient |cosine| median {_fmt(r.get('cosine_median'))} at the first checkpoint, against "
                         f"1/sqrt(projected numbers) = {_fmt(r.get('resolution'))}, the scale of a projection's error "
                         "on a cosine")  # fmt: skip
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    p.add_argument("--base-dtype", choices=("bfloat16", "float32"), default="bfloat16", help="of the saved base model")
    p.add_argument(
        "--train",
        type=int,
        default=10240,
        help="training rows (default: about 6 minutes of scoring on one H200, estimated from FLOPs)",
    )
    p.add_argument("--tokens", type=int, default=512, help="tokens per row, prompt + completion (about)")
    p.add_argument("--queries", type=int, default=256, help="rows of each of the two query sets")
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument(
        "--words", type=int, default=0, help="words of the data and tokenizer (default: min(30000, the vocabulary))"
    )
    p.add_argument("--flipped", type=float, default=0.03, help="share of training rows with a wrong completion")
    p.add_argument("--rank", type=int, default=128, help="LoRA rank")
    p.add_argument("--steps", type=int, default=10, help="AdamW steps before each adapter checkpoint")
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--pretrain-steps", type=int, default=0, help="full-parameter steps before the adapter's")
    p.add_argument("--pretrain-lr", type=float, default=1e-3)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--projection", type=int, default=16, help="projection_in = projection_out")
    p.add_argument(
        "--basis",
        choices=("random", "pca"),
        default="random",
        help="tracin.projection_basis of the cold and cached rows",
    )
    p.add_argument(  # 8 peaked at 11.7 GiB reserved on an H200 (3.6 fixed, about 0.9 a row before the completion-only
        # output layer): 32 stays within the 40 GiB; "auto" fills the card
        "--batch",
        default="32",
        help='tracin.batch_size: examples per micro-batch, or "auto"',
    )
    p.add_argument(
        "--exact-projections",
        type=lambda v: [k.strip() for k in v.split(",") if k.strip()],
        default=[],
        help="comma-separated projection sizes compared with the exact scores, a size ending in pca with "
        "tracin.projection_basis = pca (default: --projection)",
    )
    p.add_argument("--exact-train", type=int, default=512)
    p.add_argument("--exact-queries", type=int, default=16)
    p.add_argument("--dattri-train", type=int, default=1024, help="training rows of the dattri row")
    p.add_argument("--dattri-batch", type=int, default=8, help="the dattri row's data loader batch")
    p.add_argument("--dattri-fp32", action="store_true", help="the dattri row without bf16 autocast")
    p.add_argument("--rows", default="cold,cached,exact", help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--work", type=Path, help="where the model, data, adapters and runs go (default: a temp folder)")
    p.add_argument("--note", default="")
    p.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: checks the script")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if unknown := [r for r in args.rows if r not in ROWS]:
        p.error(f"--rows: unknown {', '.join(unknown)} (expected some of {', '.join(ROWS)})")
    if "dattri" in args.rows and "exact" not in args.rows:
        p.error("--rows: dattri needs exact (its agreement is measured against the exact scores)")
    args.batch = '"auto"' if args.batch == "auto" else int(args.batch)
    if args.quick:  # the sizes not given on the command line (a value equal to the default counts as given)
        given = sys.argv[1:] if argv is None else argv
        for key, value in QUICK.items():
            flag = "--" + key.replace("_", "-")
            if not any(a == flag or a.startswith(flag + "=") for a in given):
                setattr(args, key, value)
    args.device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    meta = run_meta(device, "peft", args, META_ARGS)
    report = Report(args, meta)
    measure(args, device, report)
    print(render(meta, report.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
