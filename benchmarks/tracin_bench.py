"""TracIn speed, memory and agreement: gpuopt-tui's engine against Captum's TracInCP on the same layers.

Setting: a BERT classifier built from a config and trained here for a few hundred steps (seconds on a GPU) on
a synthetic task: full-length random token sequences with two or three signal words of the label's polarity
planted (and sometimes one of the other polarity), 5% of the training labels flipped. The three checkpoints
saved during that training, with their learning rates, are the ones scored; N training x 64 test examples.

Rate: training examples scored per second against every test example over all three checkpoints, checkpoint
loading included: the median of three timed runs after an untimed warm-up run of the same mode (one timed run
for modes slower than two seconds). Peak: the largest GPU memory allocated during a timed run, weights
included. Slow modes run on a prefix of the training set; scores are compared on the rows they share.

Modes:
- ours, last layers (pooler dense + classifier, weights and biases): closed form with the trunk in fp32 or
  bf16 autocast (also with the profile's default memory clean-up, and with a random projection); the same
  parameters by torch.func vmap. Micro-batches "auto": as many examples as fit the GPU memory;
- ours, all parameters: vmap exact (fp32) and projected (bf16);
- Captum TracInCP on the same last layers: default (a backward pass per example) and
  sample_wise_grads_per_batch=True, in fp32 and with a bf16 autocast forward; Captum TracInCPFast (classifier
  weight only, no bias: another quantity); Captum TracInCP on all parameters. Captum reloads every checkpoint
  for every training batch, so each Captum mode gets one batch holding all its training rows (halved while
  that runs out of memory): its fastest setting.

Agreement, per test example across training examples and averaged over test examples where it is a
correlation:
- Spearman vs full: rank correlation with the exact all-parameter scores;
- vs fp32: against our fp32 scores of the same parameters without projection: Spearman; max error = max
  |difference| / max |reference| (set by the few largest scores); rel. error = Frobenius norm of the
  difference over that of the reference; self-inf. error = median relative error of self-influence;
- flipped AUC: how well self-influence ranks the flipped training labels above the clean ones.
A profile of the fastest unprojected mode (torch.profiler over the engine's named stages) closes the report.

Usage on a GPU machine:
    python benchmarks/tracin_bench.py --out benchmarks/results/tracin_H100.md
Quick check on a CPU (tiny model, seconds):
    python benchmarks/tracin_bench.py --quick
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpuopt_tui.jobs.data import TextDataset  # noqa: E402
from gpuopt_tui.jobs.device import is_oom  # noqa: E402
from gpuopt_tui.jobs.models.base import Adapter, Checkpoint  # noqa: E402
from gpuopt_tui.jobs.models.demo.train import TrainPlan  # noqa: E402
from gpuopt_tui.jobs.models.demo.train import train as train_model  # noqa: E402
from gpuopt_tui.jobs.models.hf import SequenceClassifierAdapter  # noqa: E402
from gpuopt_tui.jobs.tracin import TracInOptions, rank_correlation, select_parameters, tracin_scores  # noqa: E402
from gpuopt_tui.jobs.tracin.job import flipped_auc  # noqa: E402

SLOW_SECONDS = 2.0  # modes whose warm-up run takes longer are timed once more, the others three times


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
    n_all: int  # training rows for our all-parameter modes
    n_captum: int  # for Captum's per-example loop on the last layers
    n_captum_all: int  # for Captum on all parameters
    projection_dim: int
    train_epochs: int  # training the benchmark model


SIZES = {
    "quick": Size(32, 2, 2, 64, 100, 16, 64, 8, 32, 16, 8, 16, 3),
    "small": Size(256, 4, 4, 1024, 30522, 64, 4096, 64, 512, 256, 128, 1024, 6),
    "base": Size(768, 12, 12, 3072, 30522, 64, 4096, 64, 128, 128, 32, 1024, 6),
}


class BenchAdapter(SequenceClassifierAdapter):
    """Passes padding as a ready [N, 1, 1, S] boolean mask, which torch.func.vmap can trace (Hugging Face's
    2-D mask handling inspects the mask's values)."""

    def model_inputs(self, batch: dict[str, Tensor]) -> dict[str, Any]:
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"].bool()[:, None, None, :]}


@dataclass
class Outcome:
    """What one run of a mode returns: scores [n_test, n_train], self-influence [n_train] when the mode
    computes it, and the settings it ran with."""

    scores: Tensor
    self_influence: Tensor | None
    settings: str


@dataclass
class Row:
    mode: str
    layers: str
    n_train: int
    settings: str = ""
    rate: float | None = None
    peak_gib: float | None = None
    vs_captum: float | None = None
    spearman_full: float | None = None
    spearman_fp32: float | None = None
    max_error: float | None = None
    rel_error: float | None = None
    self_error: float | None = None
    flipped_auc: float | None = None
    note: str = ""
    error: str = ""
    outcome: Outcome | None = field(default=None, repr=False)


Mode = tuple[Row, Callable[[], Outcome]]
EXACT_LAST, EXACT_ALL = "ours: closed form, fp32", "ours: vmap, fp32 (exact)"


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
    plan = TrainPlan(epochs=epochs, batch_size=64, lr=5e-4, checkpoint_epochs=(epochs // 3, 2 * epochs // 3, epochs))
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
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Outcome]) -> tuple[Outcome, float, float | None]:
    """(outcome, seconds, peak GiB) of one call."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    start = time.perf_counter()
    outcome = fn()
    synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return outcome, seconds, peak


def measure(device: torch.device, fn: Callable[[], Outcome]) -> tuple[Outcome, float, float | None]:
    """(outcome, seconds, peak GiB): an untimed warm-up run, then the median of three timed runs (one when the
    warm-up took more than SLOW_SECONDS); the peak is the largest of the timed runs."""
    _, warm_up, _ = timed(device, fn)
    runs = [timed(device, fn) for _ in range(1 if warm_up > SLOW_SECONDS else 3)]
    peaks = [peak for _, _, peak in runs if peak is not None]
    return runs[-1][0], statistics.median(seconds for _, seconds, _ in runs), max(peaks) if peaks else None


def ours(
    adapter: Adapter,
    checkpoints: list[Checkpoint],
    train: TextDataset,
    test: TextDataset,
    names: list[str],
    options: TracInOptions,
) -> Callable[[], Outcome]:
    def run() -> Outcome:
        result = tracin_scores(adapter, checkpoints, train, test, names, options)
        assert result.matrix is not None
        stats = result.stats
        settings = f"micro-batch {options.batch_size} ({stats['final_batch_size']}), {options.precision}"
        if options.projection_dim:
            settings += f", projection {options.projection_dim}"
        if options.cleanup_every:
            settings += f", clean-up every {options.cleanup_every}"
        return Outcome(result.matrix.float().cpu(), result.self_influence.float().cpu(), settings)

    return run


class Logits(nn.Module):
    """model(input_ids, attention_mask) -> logits, the calling convention Captum expects; `autocast` runs the
    forward in bf16 (Captum has no precision setting of its own)."""

    def __init__(self, adapter: Adapter, autocast: bool = False) -> None:
        super().__init__()
        self.adapter = adapter
        self.inner = adapter.model
        self.autocast = autocast

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        if not self.autocast:
            return self.adapter.logits(batch)
        with torch.autocast(input_ids.device.type, dtype=torch.bfloat16):
            return self.adapter.logits(batch).float()


def captum(
    kind: str,
    adapter: Adapter,
    checkpoints: list[Checkpoint],
    train: TextDataset,
    test: TextDataset,
    modules: list[str] | None,
    autocast: bool = False,
) -> Callable[[], Outcome]:
    """A Captum mode with one training batch of all rows, halved while it runs out of memory."""
    from captum.influence import TracInCP, TracInCPFast
    from torch.utils.data import TensorDataset

    device = adapter.device
    keys = ("input_ids", "attention_mask", "labels")
    train_set = TensorDataset(*(train.tensors[k].to(device) for k in keys))
    test_batch = tuple(test.tensors[k].to(device) for k in keys)
    lrs = {str(c.path): c.lr for c in checkpoints}
    batch_size = [len(train)]

    def load(model: nn.Module, path: str) -> float:
        adapter.load_weights(Path(path))
        return lrs[path]

    def influence() -> Tensor:
        wrapper = Logits(adapter, autocast)
        common = {"checkpoints": list(lrs), "checkpoints_load_func": load, "batch_size": batch_size[0]}
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

    def run() -> Outcome:
        while True:
            try:
                scores = influence()
                break
            except Exception as exc:
                if not is_oom(exc) or batch_size[0] == 1:
                    raise
                gc.collect()
                torch.cuda.empty_cache()
                batch_size[0] //= 2
        precision = "bf16 autocast forward" if autocast else "fp32"
        return Outcome(scores.detach().float().cpu(), None, f"batch_size={batch_size[0]}, {precision}")

    return run


def max_error(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def rel_error(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def self_error(a: Tensor, b: Tensor) -> float:
    """Median over training examples of |a - b| / |b|."""
    return float(((a.double() - b.double()).abs() / b.double().abs()).median())


# --- the benchmark -----------------------------------------------------------------------------------------------------
def run(size: Size, device: torch.device) -> tuple[list[Row], dict[str, Any]]:
    """The table's rows and facts about the setting (model accuracy, the profile of the fastest mode)."""
    gpu = device.type == "cuda"
    low = "bf16" if gpu else "fp32"
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        adapter, checkpoints, train, test = build(size, device, Path(tmp))
        facts: dict[str, Any] = {"train_seconds": time.perf_counter() - start, "flipped": len(train.meta["flipped"])}
        facts["test_accuracy"] = []
        for ckpt in checkpoints:
            adapter.load_weights(ckpt.path)
            facts["test_accuracy"].append(accuracy(adapter, test))
        probe = {k: v[:1].to(device) for k, v in test.tensors.items()}
        last = select_parameters(adapter, probe, "last", 2)
        everything = select_parameters(adapter, probe, "all")
        modules = sorted({n.rsplit(".", 1)[0] for n in last})
        sub = {n: train.subset(range(min(n, len(train)))) for n in {size.n_all, size.n_captum, size.n_captum_all}}
        proj = size.projection_dim

        def ours_mode(title: str, layers: str, rows: TextDataset, names: list[str], **options: Any) -> Mode:
            return Row(title, layers, len(rows)), ours(
                adapter, checkpoints, rows, test, names, TracInOptions(**options)
            )

        def captum_mode(title: str, layers: str, rows: TextDataset, kind: str, note: str = "", **kw: Any) -> Mode:
            names = None if layers == "all" else modules
            return Row(title, layers, len(rows), note=note), captum(kind, adapter, checkpoints, rows, test, names, **kw)

        plan = [
            ours_mode(EXACT_LAST, "last", train, last),
            ours_mode(f"ours: closed form, {low} trunk", "last", train, last, precision=low),
            ours_mode(f"ours: closed form, {low} trunk", "last", train, last, precision=low, batch_size=64),
            ours_mode(
                f"ours: closed form, {low} trunk",
                "last",
                train,
                last,
                precision=low,
                cleanup_every=1000,
            ),
            ours_mode(
                f"ours: closed form, {low}, projection {proj}", "last", train, last, precision=low, projection_dim=proj
            ),
            ours_mode("ours: torch.func vmap, fp32", "last", train, last, method="vmap"),
            ours_mode(EXACT_ALL, "all", sub[size.n_all], everything),
            ours_mode(
                f"ours: vmap, {low}, projection {proj}",
                "all",
                sub[size.n_all],
                everything,
                precision=low,
                projection_dim=proj,
            ),
            captum_mode("Captum TracInCP, default", "last", sub[size.n_captum], "default"),
            captum_mode("Captum TracInCP, sample_wise_grads_per_batch", "last", train, "sample_wise"),
            *(
                [
                    captum_mode(
                        "Captum TracInCP, sample_wise_grads_per_batch", "last", train, "sample_wise", autocast=True
                    )
                ]
                if gpu  # autocast on the CPU would only time the CPU's bf16 kernels
                else []
            ),
            captum_mode("Captum TracInCPFast", "classifier.weight", train, "fast", note="no bias: another quantity"),
            captum_mode("Captum TracInCP, default", "all", sub[size.n_captum_all], "default"),
        ]
        for row, fn in plan:
            print(f"... {row.mode} [{row.layers}], {row.n_train} training examples", flush=True)
            try:
                row.outcome, seconds, row.peak_gib = measure(device, fn)
                row.settings = row.outcome.settings
                row.rate = row.n_train / seconds
            except Exception as exc:  # a failed mode (e.g. out of memory) is reported, the others still run
                row.error = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows = [row for row, _ in plan]
        compare(rows, set(train.meta["flipped"]))
        fastest = max(
            (i for i, r in enumerate(rows) if r.vs_captum and r.layers == "last" and "projection" not in r.mode),
            key=lambda i: rows[i].rate or 0,
            default=None,
        )
        if fastest is not None:
            facts["profile_mode"] = f"{rows[fastest].mode} ({rows[fastest].settings})"
            facts["profile"] = profile(device, plan[fastest][1])
    return rows, facts


def compare(rows: list[Row], flipped: set[int]) -> None:
    """Fill in agreement with the exact scores and the speed-up over Captum's fastest TracInCP mode."""
    by_mode = {r.mode: r for r in rows}
    full = by_mode[EXACT_ALL].outcome
    references = {"last": by_mode[EXACT_LAST].outcome, "all": full}
    fastest = {
        layers: max(
            (r.rate for r in rows if r.mode.startswith("Captum TracInCP,") and r.layers == layers and r.rate),
            default=None,
        )
        for layers in ("last", "all")
    }
    for row in rows:
        out = row.outcome
        if out is None:
            continue
        if full is not None:
            n = min(out.scores.shape[1], full.scores.shape[1])
            row.spearman_full = rank_correlation(out.scores[:, :n], full.scores[:, :n])
        ref = references.get(row.layers)
        if ref is not None and out is not ref:
            n = min(out.scores.shape[1], ref.scores.shape[1])
            row.spearman_fp32 = rank_correlation(out.scores[:, :n], ref.scores[:, :n])
            row.max_error = max_error(out.scores[:, :n], ref.scores[:, :n])
            row.rel_error = rel_error(out.scores[:, :n], ref.scores[:, :n])
            if out.self_influence is not None and ref.self_influence is not None:
                row.self_error = self_error(out.self_influence[:n], ref.self_influence[:n])
        if out.self_influence is not None:
            row.flipped_auc = flipped_auc(out.self_influence, torch.arange(row.n_train), flipped)
        best = fastest.get(row.layers)
        if row.mode.startswith("ours") and row.rate and best:
            row.vs_captum = row.rate / best


def profile(device: torch.device, fn: Callable[[], Outcome]) -> dict[str, Any]:
    """One run under torch.profiler: wall time, and per named stage of the engine its calls, host time and the
    GPU kernel time it launched; the host's waits for the GPU and its copy calls over the whole run."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()  # warm-up outside the profile
    synchronize(device)
    start = time.perf_counter()
    with torch_profile(activities=activities) as prof:
        fn()
        synchronize(device)
    wall = time.perf_counter() - start
    stages: dict[str, dict[str, float]] = {}
    counts: dict[str, int] = {}
    for event in prof.key_averages():
        if event.key.startswith("tracin.") and event.cpu_time_total > 0:
            stages[event.key] = {
                "calls": event.count,
                "host_ms": event.cpu_time_total / 1e3,
                "gpu_ms": event.device_time_total / 1e3,
            }
        if event.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync"):
            counts[event.key] = event.count
    return {"wall_ms": wall * 1e3, "stages": stages, "counts": counts}


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


def markdown(env: dict[str, Any], size_name: str, size: Size, rows: list[Row], facts: dict[str, Any]) -> str:
    accuracy_text = ", ".join(f"{a:.3f}" for a in facts["test_accuracy"])
    lines = [
        "# TracIn benchmark",
        "",
        f"- date: {env['date']}",
        f"- device: {env['device']} (CUDA {env['cuda']})",
        f"- versions: python {env['python']}, torch {env['torch']}, transformers {env['transformers']}, captum {env['captum']}",
        f"- command: `{env['command']}`",
        f"- model: BERT ({size_name}) hidden {size.hidden}, {size.layers} layers, vocab {size.vocab}, seq {size.seq}, "
        f"trained here in {facts['train_seconds']:.1f} s ({size.train_epochs} epochs of the {size.n_train} training "
        f"examples, {facts['flipped']} of their labels flipped); test accuracy at the 3 checkpoints: {accuracy_text}",
        f"- scored: {size.n_train} training x {size.n_test} test examples, 3 checkpoints",
        "- rate: training examples scored per second against every test example over all checkpoints, checkpoint "
        "loading included; median of 3 timed runs after a warm-up run (1 for modes slower than 2 s)",
        "- x Captum: our rate over the fastest Captum TracInCP mode on the same parameters",
        "- Spearman: rank correlation per test example across training examples, mean over test examples; "
        "vs full: with the exact all-parameter scores; vs fp32: with our fp32 scores of the same parameters "
        "without projection",
        "- max error: max |difference| / max |reference|; rel. error: Frobenius norm of the difference over that "
        "of the reference; self-inf. error: median relative error of self-influence (all against that fp32 "
        "reference)",
        "- flipped AUC: probability that self-influence ranks a flipped training label above a clean one",
        "",
        "| mode | parameters | settings | train N | train ex/s | peak GiB | x Captum | Spearman vs full "
        "| Spearman vs fp32 | max error | rel. error | self-inf. error | flipped AUC |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rate = fmt(r.rate, ".1f") if not r.error else f"failed: {r.error}"
        note = f" ({r.note})" if r.note else ""
        lines.append(
            f"| {r.mode}{note} | {r.layers} | {r.settings} | {r.n_train} | {rate} | {fmt(r.peak_gib, '.2f')} | "
            f"{fmt(r.vs_captum, '.1f')} | {fmt(r.spearman_full, '.4f')} | {fmt(r.spearman_fp32, '.4f')} | "
            f"{fmt(r.max_error, '.1e')} | {fmt(r.rel_error, '.1e')} | {fmt(r.self_error, '.1e')} | "
            f"{fmt(r.flipped_auc, '.3f')} |"
        )
    exact_last = [r.vs_captum for r in rows if r.layers == "last" and r.vs_captum and "projection" not in r.mode]
    if exact_last:
        lines += [
            "",
            f"Fastest unprojected last-layer mode over Captum's fastest TracInCP mode on the same layers: "
            f"{max(exact_last):.1f}x (goal: at least 10x).",
        ]
    if "profile" in facts:
        lines += profile_markdown(facts["profile_mode"], facts["profile"])
    return "\n".join(lines) + "\n"


def profile_markdown(mode: str, prof: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"## Where the time goes: {mode}",
        "",
        f"One run under torch.profiler: {prof['wall_ms']:.1f} ms wall (profiling adds some). Host ms: time spent "
        "inside the stage on the host, waiting for the GPU included; GPU ms: kernel and copy time the stage "
        "launched.",
        "",
        "| stage | calls | host ms | GPU ms |",
        "|---|---:|---:|---:|",
    ]
    for name, stage in sorted(prof["stages"].items(), key=lambda item: -item[1]["host_ms"]):
        lines.append(f"| {name} | {stage['calls']} | {stage['host_ms']:.1f} | {stage['gpu_ms']:.1f} |")
    counts = ", ".join(f"{name} {count}" for name, count in sorted(prof["counts"].items()))
    if counts:
        lines += ["", f"Calls over the run (a stream synchronisation is a wait of the host for the GPU): {counts}."]
    return lines


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
    rows, facts = run(size, device)
    text = markdown(env, size_name, size, rows, facts)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
        record = {
            "environment": env,
            "size": {"name": size_name, **asdict(size)},
            "facts": facts,
            "rows": [{f.name: getattr(r, f.name) for f in fields(r) if f.name != "outcome"} for r in rows],
        }
        args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
