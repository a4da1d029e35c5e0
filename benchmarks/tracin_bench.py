"""TracIn speed, memory and agreement: gpuopt-tui's engine against Captum's TracInCP on the same layers.

Setting: a BERT classifier built from a config (random weights, initializer_range 0.3 so that gradients are
not near zero), three checkpoints (perturbed copies of the weights with learning rates 1e-3, 5e-4, 2.5e-4),
random full-length token sequences, N training x 64 test examples. Rate = training examples scored per second
against every test example over all three checkpoints, checkpoint loading included. Peak = the largest GPU
memory allocated during the mode (weights included). Slow modes run on a prefix of the training set and
report their rate; all scores are compared on the training rows they share.

Modes:
- ours, last layers (pooler dense + classifier, weights and biases): closed form, trunk in bf16 or fp32;
  the same parameters by torch.func vmap; the same with a random projection;
- ours, all parameters: vmap exact (fp32) and projected (bf16);
- Captum TracInCP on the same last layers: default (a backward pass per example) and
  sample_wise_grads_per_batch=True; Captum TracInCPFast (classifier weight only, no bias: another quantity);
  Captum TracInCP on all parameters.
Agreement: Spearman rank correlation, per test example across training examples (mean over test examples),
with the exact all-parameter scores; relative error = max |difference| / max |reference| against our fp32
computation of the same parameters.

Usage on a GPU machine:
    python benchmarks/tracin_bench.py --out benchmarks/results/tracin_h100.md
Quick check on a CPU (tiny model, seconds):
    python benchmarks/tracin_bench.py --quick
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpuopt_tui.jobs.data import TextDataset  # noqa: E402
from gpuopt_tui.jobs.models.base import Adapter, Checkpoint  # noqa: E402
from gpuopt_tui.jobs.models.demo.train import TrainPlan  # noqa: E402
from gpuopt_tui.jobs.models.demo.train import train as train_model  # noqa: E402
from gpuopt_tui.jobs.models.hf import SequenceClassifierAdapter  # noqa: E402
from gpuopt_tui.jobs.tracin import TracInOptions, select_parameters, tracin_scores  # noqa: E402

LRS = (1e-3, 5e-4, 2.5e-4)


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int
    seq: int
    n_train: int
    n_test: int
    n_all: int  # training rows for the all-parameter modes
    n_captum: int  # for Captum's per-example loop on the last layers
    n_captum_fast: int  # for Captum's sample-wise and TracInCPFast modes
    n_captum_all: int  # for Captum on all parameters
    batch_last: int  # micro-batch of our last-layer modes
    batch_all: int  # micro-batch of our all-parameter modes (halved on out-of-memory)
    projection_dim: int
    train_epochs: int  # training the benchmark model


SIZES = {
    "quick": Size(32, 2, 2, 64, 100, 16, 64, 8, 32, 16, 64, 8, 32, 8, 16, 3),
    "small": Size(256, 4, 4, 1024, 30522, 64, 4096, 64, 512, 256, 2048, 128, 512, 16, 1024, 6),
    "base": Size(768, 12, 12, 3072, 30522, 64, 4096, 64, 128, 128, 1024, 32, 256, 4, 1024, 6),
}


class BenchAdapter(SequenceClassifierAdapter):
    """Passes padding as a ready [N, 1, 1, S] boolean mask, which torch.func.vmap can trace (Hugging Face's
    2-D mask handling inspects the mask's values)."""

    def model_inputs(self, batch: dict[str, Tensor]) -> dict[str, Any]:
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"].bool()[:, None, None, :]}


@dataclass
class Row:
    mode: str
    layers: str
    n_train: int
    rate: float | None = None
    peak_gib: float | None = None
    spearman_vs_full: float | None = None
    rel_error: float | None = None
    vs_captum: float | None = None
    note: str = ""
    error: str = ""
    scores: Tensor | None = field(default=None, repr=False)


Mode = tuple[Row, Callable[[], Tensor]]


# --- setup ---------------------------------------------------------------------------------------------------------
CLS, SEP, FIRST_WORD = 1, 2, 3  # token ids; words start at FIRST_WORD, the signal words first
N_SIGNALS = 16  # positive and as many negative signal words
FLIP_FRACTION = 0.05  # training labels flipped on purpose


def build(size: Size, device: torch.device, folder: Path) -> tuple[Adapter, list[Checkpoint], TextDataset, TextDataset]:
    """A BERT classifier trained on the training set (saving three checkpoints with their learning rates), the
    training set (with its flipped labels in meta["flipped"]) and a clean test set."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        intermediate_size=size.intermediate,
        max_position_embeddings=max(512, size.seq),
        num_labels=2,
    )
    model = BertForSequenceClassification(config)
    tokenizer = BertTokenizer(vocab={f"t{i}": i for i in range(size.vocab)} | {"[PAD]": 0})
    adapter = BenchAdapter("bert-bench", model, tokenizer, 2, device)
    train, test = dataset(size, size.n_train, 2, adapter, FLIP_FRACTION), dataset(size, size.n_test, 3, adapter, 0.0)
    return adapter, train_checkpoints(adapter, train, size, folder), train, test


def dataset(size: Size, n: int, seed: int, adapter: Adapter, flip: float) -> TextDataset:
    """Full-length random token sequences with 2-3 signal words of the label's polarity planted, and 0-1 of
    the other; a `flip` fraction of the labels is then flipped."""
    gen = torch.Generator().manual_seed(seed)
    first_filler = FIRST_WORD + 2 * N_SIGNALS
    ids = torch.randint(first_filler, size.vocab, (n, size.seq), generator=gen)
    ids[:, 0], ids[:, -1] = CLS, SEP
    labels = torch.randint(0, 2, (n,), generator=gen)
    slots = torch.rand(n, size.seq - 2, generator=gen).argsort(1)[:, :4] + 1  # 4 distinct inner positions
    words = FIRST_WORD + torch.randint(0, N_SIGNALS, (n, 4), generator=gen)
    polarity = labels[:, None].repeat(1, 4)  # signal words of the label's polarity in slots 0-2, other in 3
    polarity[:, 3] = 1 - labels
    words += N_SIGNALS * (1 - polarity)  # positive words first, then the negative ones
    used = torch.stack(
        [
            torch.ones(n, dtype=torch.bool),
            torch.ones(n, dtype=torch.bool),
            torch.rand(n, generator=gen) < 0.5,
            torch.rand(n, generator=gen) < 0.5,
        ],
        1,
    )
    rows = torch.arange(n)[:, None].expand(n, 4)
    ids[rows[used], slots[used]] = words[used]
    flipped = torch.randperm(n, generator=gen)[: round(n * flip)].sort().values
    labels[flipped] = 1 - labels[flipped]
    tensors = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    meta = {"flipped": flipped.tolist()}
    return TextDataset(tensors, [""] * n, dict(adapter.token_fields), f"signal-words-{seed}", meta)


def train_checkpoints(adapter: Adapter, train: TextDataset, size: Size, folder: Path) -> list[Checkpoint]:
    """Train the adapter's model on `train` (AdamW, warm-up then linear decay) and save a checkpoint after a
    third, two thirds and all of the epochs, each with the learning rate in force then."""
    epochs = size.train_epochs
    plan = TrainPlan(
        epochs=epochs, batch_size=64, lr=5e-4, checkpoint_epochs=(epochs // 3, 2 * epochs // 3, epochs)
    )
    model = adapter.model
    tensors = {k: v.to(adapter.device) for k, v in train.tensors.items()}

    def loss_fn(batch: dict[str, Tensor]) -> Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return F.cross_entropy(logits, batch["labels"])

    records, _ = train_model(model, loss_fn, tensors, train.token_fields, plan, folder / "checkpoints", seed=0)
    return [Checkpoint(folder / r["file"], r["lr"]) for r in records]


def accuracy(adapter: Adapter, ds: TextDataset) -> float:
    batch = {k: v.to(adapter.device) for k, v in ds.tensors.items()}
    with torch.no_grad():
        return float((adapter.logits(batch).argmax(-1) == batch["labels"]).float().mean())


# --- measuring -------------------------------------------------------------------------------------------------------
def measure(device: torch.device, fn: Callable[[], Tensor]) -> tuple[Tensor, float, float | None]:
    """(scores, seconds, peak GiB) of one call."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    scores = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return scores.detach().float().cpu(), seconds, peak


def ours(
    adapter: Adapter,
    checkpoints: list[Checkpoint],
    train: TextDataset,
    test: TextDataset,
    names: list[str],
    options: TracInOptions,
) -> Callable[[], Tensor]:
    def run() -> Tensor:
        result = tracin_scores(adapter, checkpoints, train, test, names, options)
        assert result.matrix is not None
        return result.matrix

    return run


class Logits(nn.Module):
    """model(input_ids, attention_mask) -> logits, the calling convention Captum expects."""

    def __init__(self, adapter: Adapter) -> None:
        super().__init__()
        self.adapter = adapter
        self.inner = adapter.model

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.adapter.logits({"input_ids": input_ids, "attention_mask": attention_mask})


def captum(
    kind: str,
    adapter: Adapter,
    checkpoints: list[Checkpoint],
    train: TextDataset,
    test: TextDataset,
    modules: list[str] | None,
    batch_size: int,
) -> Callable[[], Tensor]:
    from captum.influence import TracInCP, TracInCPFast
    from torch.utils.data import TensorDataset

    device = adapter.device
    keys = ("input_ids", "attention_mask", "labels")
    train_set = TensorDataset(*(train.tensors[k].to(device) for k in keys))
    test_batch = tuple(test.tensors[k].to(device) for k in keys)
    lrs = {str(c.path): c.lr for c in checkpoints}

    def load(model: nn.Module, path: str) -> float:
        adapter.load_weights(Path(path))
        return lrs[path]

    def run() -> Tensor:
        wrapper = Logits(adapter)
        common = {"checkpoints": list(lrs), "checkpoints_load_func": load, "batch_size": batch_size}
        if kind == "fast":
            method = TracInCPFast(
                wrapper, "inner.classifier", train_set, loss_fn=nn.CrossEntropyLoss(reduction="sum"), **common
            )
        else:
            sample_wise = kind == "sample_wise"
            method = TracInCP(
                wrapper,
                train_set,
                layers=None if modules is None else [f"inner.{m}" for m in modules],
                loss_fn=nn.CrossEntropyLoss(reduction="sum" if sample_wise else "none"),
                sample_wise_grads_per_batch=sample_wise,
                **common,
            )
        return method.influence(test_batch)

    return run


def spearman(a: Tensor, b: Tensor) -> float:
    """Mean over rows (test examples) of the rank correlation across columns (training examples)."""

    def ranks(x: Tensor) -> Tensor:
        return x.double().argsort(1).argsort(1).double()

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(1, keepdim=True), rb - rb.mean(1, keepdim=True)
    return float(((ra * rb).sum(1) / (ra.norm(dim=1) * rb.norm(dim=1))).mean())


def rel_error(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


# --- the benchmark -----------------------------------------------------------------------------------------------------
def run(size: Size, device: torch.device) -> list[Row]:
    gpu = device.type == "cuda"
    low = "bf16" if gpu else "fp32"
    with tempfile.TemporaryDirectory() as tmp:
        adapter, checkpoints, train, test = build(size, device, Path(tmp))
        probe = {k: v[:1].to(device) for k, v in test.tensors.items()}
        last = select_parameters(adapter, probe, "last", 2)
        everything = select_parameters(adapter, probe, "all")
        modules = sorted({n.rsplit(".", 1)[0] for n in last})
        sub = {
            n: train.subset(range(min(n, len(train))))
            for n in {size.n_all, size.n_captum, size.n_captum_fast, size.n_captum_all}
        }
        proj, big = size.projection_dim, size.batch_last * 16

        def ours_mode(title: str, layers: str, rows: TextDataset, names: list[str], **options: Any) -> Mode:
            fn = ours(adapter, checkpoints, rows, test, names, TracInOptions(**options))
            return Row(title, layers, len(rows)), fn

        def captum_mode(title: str, layers: str, n: int, kind: str, batch: int, note: str = "") -> Mode:
            names = None if layers == "all" else modules
            return Row(title, layers, n, note=note), captum(kind, adapter, checkpoints, sub[n], test, names, batch)

        plan = [
            ours_mode("ours: closed form, fp32", "last", train, last, batch_size=big),
            ours_mode(f"ours: closed form, {low} trunk", "last", train, last, precision=low, batch_size=big),
            ours_mode(
                f"ours: closed form, {low}, projection {proj}",
                "last",
                train,
                last,
                precision=low,
                projection_dim=proj,
                batch_size=big,
            ),
            ours_mode("ours: torch.func vmap, fp32", "last", train, last, method="vmap", batch_size=big // 4),
            ours_mode("ours: vmap, fp32 (exact)", "all", sub[size.n_all], everything, batch_size=size.batch_all),
            ours_mode(
                f"ours: vmap, {low}, projection {proj}",
                "all",
                sub[size.n_all],
                everything,
                precision=low,
                projection_dim=proj,
                batch_size=size.batch_all,
            ),
            captum_mode("Captum TracInCP, default", "last", size.n_captum, "default", size.batch_last),
            captum_mode(
                "Captum TracInCP, sample_wise_grads_per_batch",
                "last",
                size.n_captum_fast,
                "sample_wise",
                size.batch_last * 4,
            ),
            captum_mode(
                "Captum TracInCPFast",
                "classifier.weight",
                size.n_captum_fast,
                "fast",
                size.batch_last * 4,
                note="no bias: another quantity",
            ),
            captum_mode("Captum TracInCP, default", "all", size.n_captum_all, "default", size.batch_last),
        ]
        ours(adapter, checkpoints, sub[size.n_captum_all], test, last, TracInOptions(precision=low))()  # warm-up
        for row, fn in plan:
            print(f"... {row.mode} [{row.layers}], {row.n_train} training examples", flush=True)
            try:
                row.scores, seconds, row.peak_gib = measure(device, fn)
                row.rate = row.n_train / seconds
            except Exception as exc:  # a failed mode (e.g. out of memory) is reported, the others still run
                row.error = f"{type(exc).__name__}: {str(exc)[:200]}"
    rows = [row for row, _ in plan]
    compare(rows, exact_last=rows[0], exact_all=rows[4])
    return rows


def compare(rows: list[Row], exact_last: Row, exact_all: Row) -> None:
    """Fill in agreement with the exact scores and the speed-up over Captum's fastest TracInCP mode."""
    fastest = {
        layers: max(
            (r.rate for r in rows if r.mode.startswith("Captum TracInCP,") and r.layers == layers and r.rate),
            default=None,
        )
        for layers in ("last", "all")
    }
    for row in rows:
        if row.scores is None:
            continue
        if exact_all.scores is not None:
            n = min(row.scores.shape[1], exact_all.scores.shape[1])
            row.spearman_vs_full = spearman(row.scores[:, :n], exact_all.scores[:, :n])
        reference = {"all": exact_all, "last": exact_last}.get(row.layers)
        if reference is not None and reference.scores is not None:
            n = min(row.scores.shape[1], reference.scores.shape[1])
            row.rel_error = rel_error(row.scores[:, :n], reference.scores[:, :n])
        best = fastest.get(row.layers)
        if row.mode.startswith("ours") and row.rate and best:
            row.vs_captum = row.rate / best


# --- reporting ---------------------------------------------------------------------------------------------------------
def environment(device: torch.device) -> dict[str, Any]:
    import captum
    import transformers

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({platform.processor() or platform.machine()})",
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "captum": captum.__version__,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }


def fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def markdown(env: dict[str, Any], size_name: str, size: Size, rows: list[Row]) -> str:
    lines = [
        "# TracIn benchmark",
        "",
        f"- date: {env['date']}",
        f"- device: {env['device']} (CUDA {env['cuda']})",
        f"- versions: python {env['python']}, torch {env['torch']}, transformers {env['transformers']}, captum {env['captum']}",
        f"- command: `{env['command']}`",
        f"- model: BERT ({size_name}) hidden {size.hidden}, {size.layers} layers, vocab {size.vocab}, seq {size.seq}; "
        f"{size.n_train} training x {size.n_test} test examples, {len(LRS)} checkpoints",
        "- rate: training examples scored per second against every test example over all checkpoints",
        "- Spearman: rank correlation with the exact all-parameter scores, per test example, mean over test examples",
        "- rel. error: max |difference| / max |reference| against our fp32 scores of the same parameters",
        "- x Captum: our rate over the fastest Captum TracInCP mode on the same parameters",
        "",
        "| mode | parameters | train N | train ex/s | peak GiB | Spearman vs full | rel. error | x Captum |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rate = fmt(r.rate, ".1f") if not r.error else f"failed: {r.error}"
        note = f" ({r.note})" if r.note else ""
        lines.append(
            f"| {r.mode}{note} | {r.layers} | {r.n_train} | {rate} | {fmt(r.peak_gib, '.2f')} | "
            f"{fmt(r.spearman_vs_full, '.4f')} | {fmt(r.rel_error, '.1e')} | {fmt(r.vs_captum, '.1f')} |"
        )
    exact_last = [r.vs_captum for r in rows if r.layers == "last" and r.vs_captum and "projection" not in r.mode]
    if exact_last:
        lines += [
            "",
            f"Fastest unprojected last-layer mode over Captum's fastest TracInCP mode on the same layers: "
            f"{max(exact_last):.1f}x (goal: at least 10x).",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU, seconds (checks the script)")
    parser.add_argument("--model", choices=("small", "base"), default="small", help="BERT-small (4x256) or BERT-base")
    parser.add_argument("--out", type=Path, help="write a markdown results file here, and JSON beside it")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when there is one)")
    args = parser.parse_args(argv)
    size_name = "quick" if args.quick else args.model
    size = SIZES[size_name]
    device = torch.device(args.device or ("cpu" if args.quick or not torch.cuda.is_available() else "cuda"))
    if args.quick:
        torch.set_num_threads(1)
    env = environment(device)
    rows = run(size, device)
    text = markdown(env, size_name, size, rows)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
        record = {
            "environment": env,
            "size": {"name": size_name, **asdict(size)},
            "rows": [{k: v for k, v in asdict(r).items() if k != "scores"} for r in rows],
        }
        args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
