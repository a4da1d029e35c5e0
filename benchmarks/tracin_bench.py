"""TracIn speed, memory and agreement: gpuopt-tui's engine against Captum's TracInCP on the same layers.

Setting: a BERT classifier built from a config and trained here for a few hundred steps (seconds on a GPU) on
a synthetic task: full-length random token sequences with two or three signal words of the label's polarity
planted (and sometimes one of the other polarity), 5% of the training labels flipped. The three checkpoints
saved during that training, with their learning rates, are the ones scored; N training x M test examples
(--train, --test; 4096 x 64 by default). The model is trained on the first 4096 training examples whatever N
is (all of them when N is smaller): the data are drawn 4096 rows per seed, so those rows are the same for
every N, and the training cost does not grow with N. --checkpoint-cache DIR keeps the trained checkpoints
there and reuses them in later runs of the same model and training rows (e.g. another N).

Rate: training examples scored per second against every test example over all three checkpoints, checkpoint
loading included: the median of three timed runs after an untimed warm-up run of the same mode (one timed run
for modes slower than two seconds). Peak: the largest GPU memory allocated during a timed run, weights
included.

Modes (--modes takes a comma list of these names and of the group names ours-last, ours-all, captum-last,
captum-all; all of them by default):
- ours-last, last layers (pooler dense + classifier, weights and biases), micro-batches "auto" (as many
  examples as fit the GPU memory) unless said: closed-fp32 (closed form, fp32: the reference of the "vs fp32"
  columns), closed-low (trunk in bf16 autocast; fp32 on a CPU), closed-low-serial (the same without reading
  the next checkpoint ahead), closed-mb64 (micro-batches of 64), closed-cleanup (the profile's memory
  clean-up), closed-proj (random projection), vmap-last (the same parameters by torch.func vmap);
- ours-all, all parameters: vmap-all (exact, fp32: the reference of the "vs full" column), vmap-all-proj
  (bf16, projected);
- captum-last, Captum TracInCP on the same last layers: captum-default (a backward pass per example),
  captum-sw (sample_wise_grads_per_batch=True, fp32), captum-sw-bf16 (the same with a bf16 autocast forward;
  GPU only), captum-fast (TracInCPFast: classifier weight only, no bias, another quantity);
- captum-all: captum-default-all (Captum TracInCP on all parameters).
Captum reloads every checkpoint for every training batch, so each Captum mode gets one batch holding all its
training rows (halved while that runs out of memory): its fastest setting. The slow modes (vmap-all,
vmap-all-proj, captum-default, captum-default-all) are capped: they score the first 512, 512, 256 and 128
training examples (BERT-small) whatever N is, which the results file says on their rows; scores are
compared on the rows shared with the reference.

Agreement, per test example across training examples and averaged over test examples where it is a
correlation:
- Spearman vs full: rank correlation with the exact all-parameter scores;
- vs fp32: against our fp32 scores of the same parameters without projection: Spearman; max error = max
  |difference| / max |reference| (set by the few largest scores); rel. error = Frobenius norm of the
  difference over that of the reference; self-inf. error = median relative error of self-influence;
- flipped AUC: how well self-influence ranks the flipped training labels above the clean ones.
A profile of the fastest unprojected last-layer mode of ours (torch.profiler over the engine's named stages)
closes the report.

Usage on a GPU machine:
    python benchmarks/tracin_bench.py --out benchmarks/results/tracin_H100.md
    python benchmarks/tracin_bench.py --train 32768 --modes ours-last,vmap-all,captum-last \
        --out benchmarks/results/tracin_H100_32k.md
Quick check on a CPU (tiny model, seconds):
    python benchmarks/tracin_bench.py --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpuopt_tui.core.atomic import atomic_write_text, write_json  # noqa: E402
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
    n_train: int  # training examples scored (--train)
    n_test: int  # test examples (--test)
    n_fit: int  # the model is trained on the first n_fit training examples (all when there are fewer)
    n_all: int  # training rows for our all-parameter modes
    n_captum: int  # for Captum's per-example loop on the last layers
    n_captum_all: int  # for Captum on all parameters
    projection_dim: int
    train_epochs: int  # training the benchmark model
    train_lr: float  # AdamW's peak learning rate for that training


SIZES = {
    "quick": Size(32, 2, 2, 64, 100, 16, 64, 8, 64, 32, 16, 8, 16, 3, 5e-4),
    # BERT-small at 5e-4 reached a held-out accuracy of 0.84, at 1e-4 0.94 (results/tracin_recipes_small_H200.md)
    "small": Size(256, 4, 4, 1024, 30522, 64, 4096, 64, 4096, 512, 256, 128, 1024, 6, 1e-4),
    # BERT-base at 5e-4 (6 epochs on 4096 examples) and at 1e-4 (9 epochs on 4096, or 3 on 20480) stayed at chance:
    # all-parameter scores whose ranks within each sign are rounding noise (results/tracin_faithfulness_cpu.md);
    # 3e-5 for 3 epochs on 20480 examples reaches a held-out accuracy of 0.99 (results/tracin_recipes_H200.md)
    "base": Size(768, 12, 12, 3072, 30522, 64, 4096, 64, 20480, 128, 128, 32, 1024, 3, 3e-5),
}

MODE_GROUPS: dict[str, tuple[str, ...]] = {
    "ours-last": (
        "closed-fp32",
        "closed-low",
        "closed-low-serial",
        "closed-mb64",
        "closed-cleanup",
        "closed-proj",
        "vmap-last",
    ),
    "ours-all": ("vmap-all", "vmap-all-proj"),
    "captum-last": ("captum-default", "captum-sw", "captum-sw-bf16", "captum-fast"),
    "captum-all": ("captum-default-all",),
}
MODES = tuple(key for keys in MODE_GROUPS.values() for key in keys)
REFERENCE_LAST, REFERENCE_ALL = "closed-fp32", "vmap-all"  # the "vs fp32" and "vs full" references
GOAL_RATIO, GOAL_TRAIN, GOAL_TEST = 10.0, 4096, 64  # x Captum, on at least this many training x test examples


def parse_modes(text: str) -> list[str]:
    """Mode names from a comma list of mode and group names ("all": every mode), in the table's order."""
    wanted: set[str] = set()
    for item in (part.strip() for part in text.split(",")):
        if item == "all":
            wanted.update(MODES)
        elif item in MODE_GROUPS:
            wanted.update(MODE_GROUPS[item])
        elif item in MODES:
            wanted.add(item)
        else:
            choices = ", ".join(["all", *MODE_GROUPS, *MODES])
            raise argparse.ArgumentTypeError(f"unknown mode {item!r}; choose from {choices}")
    return [key for key in MODES if key in wanted]


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
    key: str  # the mode's name for --modes
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
    skipped: str = ""  # why the mode did not run here
    error: str = ""
    outcome: Outcome | None = field(default=None, repr=False)


Mode = tuple[Row, Callable[[], Outcome]]


# --- setup ---------------------------------------------------------------------------------------------------------
CLS, SEP, FIRST_WORD = 1, 2, 3  # token ids; words start at FIRST_WORD, the signal words first
N_SIGNALS = 16  # positive and as many negative signal words
FLIP_FRACTION = 0.05  # training labels flipped on purpose


def build(
    size: Size, device: torch.device, folder: Path, cache: Path | None
) -> tuple[Adapter, list[Checkpoint], TextDataset, TextDataset, dict[str, Any]]:
    """A BERT classifier trained on the first `size.n_fit` training examples (saving three checkpoints with their
    learning rates, or reusing those in `cache`), the training set (with its flipped labels in meta["flipped"]),
    a clean test set, and how the checkpoints came about."""
    adapter = bert_adapter("bert-bench", size, device)
    train, test = dataset(size, size.n_train, 2, adapter, FLIP_FRACTION), dataset(size, size.n_test, 3, adapter, 0.0)
    checkpoints, training = trained_checkpoints(adapter, train.head(size.n_fit), size, folder, cache)
    return adapter, checkpoints, train, test, training


def bert_adapter(name: str, size: Size, device: torch.device) -> BenchAdapter:
    """A freshly initialised (seed 0) two-class BERT of `size`, with a tokenizer of its made-up vocabulary."""
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
    tokenizer = BertTokenizer(vocab={f"t{i}": i for i in range(size.vocab)} | {"[PAD]": 0})
    return BenchAdapter(name, BertForSequenceClassification(config), tokenizer, 2, device)


DRAW_ROWS = 4096  # rows drawn per seed: the first k * DRAW_ROWS rows of a data set are the same for every size


def dataset(size: Size, n: int, seed: int, adapter: Adapter, flip: float) -> TextDataset:
    """Full-length random token sequences with 2-3 signal words of the label's polarity planted, and 0-1 of
    the other; a `flip` fraction of the labels is then flipped (in each run of DRAW_ROWS rows)."""
    parts = [
        signal_rows(size, min(DRAW_ROWS, n - start), seed + 1000 * (start // DRAW_ROWS), flip)
        for start in range(0, n, DRAW_ROWS)
    ]
    ids = torch.cat([p[0] for p in parts])
    labels = torch.cat([p[1] for p in parts])
    flipped = torch.cat([p[2] + k * DRAW_ROWS for k, p in enumerate(parts)])
    tensors = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    meta = {"flipped": flipped.tolist()}
    return TextDataset(tensors, [""] * n, dict(adapter.token_fields), f"signal-words-{seed}", meta)


def signal_rows(size: Size, n: int, seed: int, flip: float) -> tuple[Tensor, Tensor, Tensor]:
    """(token ids [n, seq], labels [n], flipped rows) of `dataset`, drawn from one seed."""
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
    return ids, labels, flipped


def trained_checkpoints(
    adapter: Adapter, fit: TextDataset, size: Size, folder: Path, cache: Path | None
) -> tuple[list[Checkpoint], dict[str, Any]]:
    """The checkpoints of `train_checkpoints` on `fit`, saved under `folder`; with a `cache` folder, saved there
    instead, or reused from there when a run with the same model and training rows saved them before."""
    key = (
        f"bert-h{size.hidden}-l{size.layers}-v{size.vocab}-s{size.seq}-fit{len(fit)}-e{size.train_epochs}-lr{size.train_lr:g}"
        f"-flip{FLIP_FRACTION}-{adapter.device.type}"
    )
    root = (cache or folder) / key
    manifest = root / "checkpoints.json"
    if cache is not None and manifest.is_file():
        saved = json.loads(manifest.read_text(encoding="utf-8"))
        checkpoints = [Checkpoint(root / file, lr) for file, lr in saved["checkpoints"]]
        if all(c.path.is_file() for c in checkpoints):
            return checkpoints, {"seconds": saved["seconds"], "fit": len(fit), "reused_from": str(root)}
    start = time.perf_counter()
    checkpoints = train_checkpoints(adapter, fit, size, root)
    seconds = time.perf_counter() - start
    if cache is not None:
        write_json(
            manifest,
            {"checkpoints": [[c.path.relative_to(root).as_posix(), c.lr] for c in checkpoints], "seconds": seconds},
        )
    return checkpoints, {"seconds": seconds, "fit": len(fit), "reused_from": None}


def train_checkpoints(adapter: Adapter, train: TextDataset, size: Size, folder: Path) -> list[Checkpoint]:
    """Train the adapter's model on `train` (AdamW, warm-up then linear decay) and save a checkpoint after a
    third, two thirds and all of the epochs, each with the learning rate in force then."""
    epochs = size.train_epochs
    plan = TrainPlan(
        epochs=epochs, batch_size=64, lr=size.train_lr, checkpoint_epochs=(epochs // 3, 2 * epochs // 3, epochs)
    )
    model = adapter.model
    tensors = {k: v.to(adapter.device) for k, v in train.tensors.items()}

    def loss_fn(batch: dict[str, Tensor]) -> Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return F.cross_entropy(logits, batch["labels"])

    records, _ = train_model(model, loss_fn, tensors, train.token_fields, plan, folder / "checkpoints", seed=0)
    return [Checkpoint(folder / r["file"], r["lr"]) for r in records]


def checkpoint_accuracy(adapter: Adapter, checkpoints: list[Checkpoint], ds: TextDataset) -> list[float]:
    """Accuracy on `ds` at each checkpoint (the last one stays loaded)."""
    batch = {k: v.to(adapter.device) for k, v in ds.tensors.items()}
    out = []
    for ckpt in checkpoints:
        adapter.load_weights(ckpt.path)
        with torch.no_grad():
            out.append(float((adapter.logits(batch).argmax(-1) == batch["labels"]).float().mean()))
    return out


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
        if options.method == "factored":  # tracin_projected_bench.py's modes
            sizes = f"{options.projection_out} x {options.projection_in}" if options.projection_in else "exact"
            settings += f", factored {sizes} per layer, {stats['gradient_size']:,} numbers per gradient"
        if options.cleanup_every:
            settings += f", clean-up every {options.cleanup_every}"
        if not options.prefetch:
            settings += ", no read-ahead of checkpoints"
        if len(train) > options.shard_size:
            settings += f", blocks of {options.shard_size}"
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
    """A Captum mode with one training batch of all rows and one call for all test examples; while it runs out
    of memory, the larger of the two is halved (the test examples then go to Captum in chunks, each of which
    recomputes the training gradients: what a user of Captum must do when they do not fit)."""
    from captum.influence import TracInCP, TracInCPFast
    from torch.utils.data import TensorDataset

    device = adapter.device
    keys = ("input_ids", "attention_mask", "labels")
    train_set = TensorDataset(*(train.tensors[k].to(device) for k in keys))
    test_rows = tuple(test.tensors[k].to(device) for k in keys)
    lrs = {str(c.path): c.lr for c in checkpoints}
    batch_size, test_chunk = [len(train)], [len(test)]

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
        chunks = [tuple(t[i : i + test_chunk[0]] for t in test_rows) for i in range(0, len(test), test_chunk[0])]
        return torch.cat([method.influence(chunk) for chunk in chunks])

    def run() -> Outcome:
        while True:
            try:
                scores = influence()
                break
            except Exception as exc:
                if not is_oom(exc) or batch_size[0] == test_chunk[0] == 1:
                    raise
                gc.collect()
                torch.cuda.empty_cache()
                larger = batch_size if batch_size[0] >= test_chunk[0] else test_chunk
                larger[0] //= 2
        precision = "bf16 autocast forward" if autocast else "fp32"
        chunked = f", test examples in chunks of {test_chunk[0]}" if test_chunk[0] < len(test) else ""
        return Outcome(scores.detach().float().cpu(), None, f"batch_size={batch_size[0]}{chunked}, {precision}")

    return run


def max_error(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def rel_error(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def self_error(a: Tensor, b: Tensor) -> float:
    """Median over training examples of |a - b| / |b|."""
    return float(((a.double() - b.double()).abs() / b.double().abs()).median())


# --- the benchmark -----------------------------------------------------------------------------------------------------
def run(size: Size, device: torch.device, modes: list[str], cache: Path | None) -> tuple[list[Row], dict[str, Any]]:
    """The table's rows (the chosen `modes`) and facts about the setting (model accuracy, the fastest Captum
    TracInCP modes, the profile of our fastest last-layer mode)."""
    gpu = device.type == "cuda"
    low = "bf16" if gpu else "fp32"
    with tempfile.TemporaryDirectory() as tmp:
        adapter, checkpoints, train, test, training = build(size, device, Path(tmp), cache)
        facts: dict[str, Any] = {"training": training, "flipped": len(train.meta["flipped"])}
        facts["test_accuracy"] = checkpoint_accuracy(adapter, checkpoints, test)
        probe = {k: v[:1].to(device) for k, v in test.tensors.items()}
        last = select_parameters(adapter, probe, "last", 2)
        everything = select_parameters(adapter, probe, "all")
        modules = sorted({n.rsplit(".", 1)[0] for n in last})
        proj = size.projection_dim

        def capped(rows: TextDataset) -> str:
            return (
                ""
                if len(rows) == len(train)
                else f"capped: the first {len(rows)} of the {len(train)} training examples"
            )

        def ours_mode(key: str, title: str, layers: str, rows: TextDataset, names: list[str], **options: Any) -> Mode:
            row = Row(key, title, layers, len(rows), note=capped(rows))
            return row, ours(adapter, checkpoints, rows, test, names, TracInOptions(**options))

        def captum_mode(
            key: str, title: str, layers: str, rows: TextDataset, kind: str, note: str = "", **kw: Any
        ) -> Mode:
            names = None if layers == "all" else modules
            row = Row(key, title, layers, len(rows), note=", ".join(filter(None, [note, capped(rows)])))
            return row, captum(kind, adapter, checkpoints, rows, test, names, **kw)

        closed_low = f"ours: closed form, {low} trunk"
        plan = [
            ours_mode(REFERENCE_LAST, "ours: closed form, fp32", "last", train, last),
            ours_mode("closed-low", closed_low, "last", train, last, precision=low),
            ours_mode("closed-low-serial", closed_low, "last", train, last, precision=low, prefetch=False),
            ours_mode("closed-mb64", closed_low, "last", train, last, precision=low, batch_size=64),
            ours_mode("closed-cleanup", closed_low, "last", train, last, precision=low, cleanup_every=1000),
            ours_mode(
                "closed-proj",
                f"ours: closed form, {low}, projection {proj}",
                "last",
                train,
                last,
                precision=low,
                projection_dim=proj,
            ),
            ours_mode("vmap-last", "ours: torch.func vmap, fp32", "last", train, last, method="vmap"),
            ours_mode(REFERENCE_ALL, "ours: vmap, fp32 (exact)", "all", train.head(size.n_all), everything),
            ours_mode(
                "vmap-all-proj",
                f"ours: vmap, {low}, projection {proj}",
                "all",
                train.head(size.n_all),
                everything,
                precision=low,
                projection_dim=proj,
            ),
            captum_mode("captum-default", "Captum TracInCP, default", "last", train.head(size.n_captum), "default"),
            captum_mode("captum-sw", "Captum TracInCP, sample_wise_grads_per_batch", "last", train, "sample_wise"),
            captum_mode(
                "captum-sw-bf16",
                "Captum TracInCP, sample_wise_grads_per_batch",
                "last",
                train,
                "sample_wise",
                autocast=True,
            ),
            captum_mode(
                "captum-fast", "Captum TracInCPFast", "classifier.weight", train, "fast", "no bias: another quantity"
            ),
            captum_mode(
                "captum-default-all", "Captum TracInCP, default", "all", train.head(size.n_captum_all), "default"
            ),
        ]
        plan = [(row, fn) for row, fn in plan if row.key in modes]
        for row, fn in plan:
            if row.key == "captum-sw-bf16" and not gpu:
                row.settings = "bf16 autocast forward"
                row.skipped = "GPU only (on a CPU it would time the CPU's bf16 kernels)"
                continue
            print(f"... {row.key}: {row.mode} [{row.layers}], {row.n_train} training examples", flush=True)
            try:
                row.outcome, seconds, row.peak_gib = measure(device, fn)
                row.settings = row.outcome.settings
                row.rate = row.n_train / seconds
            except Exception as exc:  # a failed mode (e.g. out of memory) is reported, the others still run
                row.error = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows = [row for row, _ in plan]
        facts["captum_fastest"] = compare(rows, set(train.meta["flipped"]))
        exact_last = [i for i, r in enumerate(rows) if r.key in MODE_GROUPS["ours-last"] and r.key != "closed-proj"]
        fastest = max((i for i in exact_last if rows[i].rate), key=lambda i: rows[i].rate or 0.0, default=None)
        if fastest is not None:
            facts["profile_mode"] = f"{rows[fastest].mode} ({rows[fastest].settings})"
            facts["profile"] = profile(device, plan[fastest][1])
    return rows, facts


def compare(rows: list[Row], flipped: set[int]) -> dict[str, dict[str, Any]]:
    """Fill in agreement with the exact scores (where the reference modes ran) and the speed-up over Captum's
    fastest TracInCP mode on the same layers; returns that mode per layer choice ("last", "all")."""
    by_key = {r.key: r for r in rows}
    full = by_key[REFERENCE_ALL].outcome if REFERENCE_ALL in by_key else None
    references = {
        layers: by_key[key].outcome
        for layers, key in (("last", REFERENCE_LAST), ("all", REFERENCE_ALL))
        if key in by_key
    }
    fastest: dict[str, Row] = {}
    for r in rows:
        if (
            r.mode.startswith("Captum TracInCP,")
            and r.rate
            and (r.layers not in fastest or r.rate > fastest[r.layers].rate)
        ):
            fastest[r.layers] = r
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
        if row.mode.startswith("ours") and row.rate and best is not None:
            row.vs_captum = row.rate / best.rate
    return {
        layers: {"key": r.key, "mode": r.mode, "settings": r.settings, "rate": r.rate} for layers, r in fastest.items()
    }


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
    training = facts["training"]
    fit = (
        f"the first {training['fit']} of the {size.n_train}"
        if training["fit"] < size.n_train
        else f"the {size.n_train}"
    )
    seconds = f"{training['seconds']:.1f} s"
    how = f"checkpoints reused from {training['reused_from']}, trained in {seconds} by an earlier run"
    how = how if training["reused_from"] else f"here, in {seconds}"
    ran = {r.key for r in rows}
    lines = [
        "# TracIn benchmark",
        "",
        f"- date: {env['date']}",
        f"- device: {env['device']} (CUDA {env['cuda']})",
        f"- versions: python {env['python']}, torch {env['torch']}, transformers {env['transformers']}, captum {env['captum']}",
        f"- command: `{env['command']}`",
        f"- model: BERT ({size_name}) hidden {size.hidden}, {size.layers} layers, vocab {size.vocab}, seq {size.seq}, "
        f"trained for {size.train_epochs} epochs at a peak lr of {size.train_lr:g} on {fit} training examples ({how}); {facts['flipped']} of the "
        f"{size.n_train} training labels flipped; test accuracy at the 3 checkpoints: {accuracy_text}",
        f"- scored: N = {size.n_train} training x M = {size.n_test} test examples, 3 checkpoints",
        f"- modes run: {', '.join(r.key for r in rows)}"
        + (f"; not run (--modes): {', '.join(k for k in MODES if k not in ran)}" if len(ran) < len(MODES) else ""),
        "- rate: training examples scored per second against every test example over all checkpoints, checkpoint "
        "loading included; median of 3 timed runs after a warm-up run (1 for modes slower than 2 s)",
        "- capped modes (slow per example) score only a prefix of the training set whatever N is: the row says "
        "so and its train N column gives the prefix; their rate is per example on that prefix, and agreement is "
        "computed on the rows shared with the reference",
        "- x Captum: our rate over the fastest Captum TracInCP mode on the same parameters in this run",
        "- Spearman: rank correlation per test example across training examples, mean over test examples; "
        "vs full: with the exact all-parameter scores (mode vmap-all); vs fp32: with our fp32 scores of the same "
        "parameters without projection (mode closed-fp32 for the last layers)",
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
        rate = f"skipped: {r.skipped}" if r.skipped else f"failed: {r.error}" if r.error else fmt(r.rate, ".1f")
        note = f" ({r.note})" if r.note else ""
        lines.append(
            f"| {r.mode}{note} | {r.layers} | {r.settings} | {r.n_train} | {rate} | {fmt(r.peak_gib, '.2f')} | "
            f"{fmt(r.vs_captum, '.1f')} | {fmt(r.spearman_full, '.4f')} | {fmt(r.spearman_fp32, '.4f')} | "
            f"{fmt(r.max_error, '.1e')} | {fmt(r.rel_error, '.1e')} | {fmt(r.self_error, '.1e')} | "
            f"{fmt(r.flipped_auc, '.3f')} |"
        )
    lines += ["", goal_line(size, rows, facts["captum_fastest"].get("last"))]
    if "profile" in facts:
        lines += profile_markdown(facts["profile_mode"], facts["profile"])
    return "\n".join(lines) + "\n"


def goal_line(size: Size, rows: list[Row], captum_best: dict[str, Any] | None) -> str:
    """Our fastest unprojected last-layer mode against Captum TracInCP on the same layers as it ships (default
    arguments: one backward pass per training example), which the goal names, and against Captum's fastest
    TracInCP configuration in this run (an opt-in mode), with the goal's verdict or why it cannot say."""
    goal = (
        f"goal: at least {GOAL_RATIO:g}x Captum TracInCP (default arguments) on the same layers at {GOAL_TRAIN} x "
        f"{GOAL_TEST} or more examples"
    )
    ours_last = [r for r in rows if r.key in MODE_GROUPS["ours-last"] and r.key != "closed-proj" and r.rate]
    if not ours_last:
        return f"No unprojected last-layer mode of ours ran: {goal} not measured."
    best = max(ours_last, key=lambda r: r.rate or 0.0)
    assert best.rate is not None
    text = (
        f"Fastest unprojected last-layer mode of ours at {size.n_train} training x {size.n_test} test examples: "
        f"{best.mode} ({best.settings}), {best.rate:.1f} ex/s"
    )
    default = next((r for r in rows if r.key == "captum-default" and r.rate), None)
    if captum_best is not None and best.vs_captum is not None:
        text += (
            f"; {best.vs_captum:.1f}x Captum's fastest TracInCP configuration in this run ({captum_best['mode']}, "
            f"{captum_best['settings']}: {captum_best['rate']:.1f} ex/s)"
        )
    if default is None or default.rate is None:
        return f"{text}; Captum TracInCP with its default arguments did not run, so the {goal}, is not measured."
    ratio = best.rate / default.rate
    text += f"; {ratio:.1f}x Captum TracInCP with its default arguments ({default.rate:.1f} ex/s); {goal}: "
    if size.n_train < GOAL_TRAIN or size.n_test < GOAL_TEST:
        return text + "not measured (this run is smaller)."
    return text + ("met." if ratio >= GOAL_RATIO else "not met.")


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
    add_common_arguments(parser, "(default 4096; 64 with --quick)", "(default 64; 8 with --quick)")
    parser.add_argument(
        "--modes",
        type=parse_modes,
        default=list(MODES),
        help=f"comma list of modes ({', '.join(MODES)}) and groups ({', '.join(MODE_GROUPS)}); default: all",
    )
    args = parser.parse_args(argv)
    size_name, size = chosen_size(args)
    size = dataclasses.replace(size, n_train=args.train or size.n_train, n_test=args.test or size.n_test)
    device = chosen_device(args)
    env = environment(device)
    rows, facts = run(size, device, args.modes, args.checkpoint_cache)
    text = markdown(env, size_name, size, rows, facts)
    size_record = {"name": size_name, **asdict(size)}
    return report(args.out, text, {"environment": env, "size": size_record, "modes": args.modes, "facts": facts}, rows)


# --- what both TracIn benchmarks (this one and tracin_projected_bench.py) share -------------------------------------
def add_common_arguments(parser: argparse.ArgumentParser, train_default: str, test_default: str) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU (checks the script)")
    parser.add_argument("--model", choices=("small", "base"), default="small", help="BERT-small (4x256) or BERT-base")
    parser.add_argument("--train", type=positive, help=f"training examples N {train_default}")
    parser.add_argument("--test", type=positive, help=f"test examples M {test_default}")
    parser.add_argument("--checkpoint-cache", type=Path, help="keep the trained checkpoints here and reuse them")
    parser.add_argument("--train-epochs", type=positive, help="epochs training the model (default: 6; 3 for base)")
    parser.add_argument("--train-lr", type=float, help="AdamW's peak learning rate (default: 1e-4; 3e-5 for base)")
    parser.add_argument(
        "--train-fit",
        type=positive,
        help="the model is trained on the first this many training examples (default: 4096; 20480 for base)",
    )
    parser.add_argument("--out", type=Path, help="write a markdown results file here, and JSON beside it")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when there is one)")


def chosen_size(args: argparse.Namespace) -> tuple[str, Size]:
    """The model's name and size from --quick / --model, with --train-epochs, --train-lr and --train-fit applied."""
    name = "quick" if args.quick else args.model
    size = SIZES[name]
    return name, dataclasses.replace(
        size,
        train_epochs=args.train_epochs or size.train_epochs,
        train_lr=args.train_lr or size.train_lr,
        n_fit=args.train_fit or size.n_fit,
    )


def chosen_device(args: argparse.Namespace) -> torch.device:
    """--device, else the CPU for --quick or without a GPU, else cuda; --quick runs on one thread."""
    device = torch.device(args.device or ("cpu" if args.quick or not torch.cuda.is_available() else "cuda"))
    if args.quick:
        torch.set_num_threads(1)
    return device


def report(out: Path | None, text: str, record: dict[str, Any], rows: Sequence[Any]) -> int:
    """Print the markdown; with --out also write it and the JSON record (with each row's fields but its outcome)
    beside it. The exit code: 1 when a row failed."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, text)
        row_fields = [{f.name: getattr(r, f.name) for f in fields(r) if f.name != "outcome"} for r in rows]
        write_json(out.with_suffix(".json"), {**record, "rows": row_fields})
    return 1 if any(r.error for r in rows) else 0


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of examples, got {text}")
    return value


if __name__ == "__main__":
    raise SystemExit(main())
