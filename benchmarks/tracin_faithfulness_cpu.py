"""What makes projected all-layer TracIn disagree with exact TracIn: precision, projection, the lean forward, or
the state of the model. A CPU diagnosis in minutes.

For each case, a BERT classifier built from a config (dropout 0.1, like the benchmarks' models) is trained with
tracin_bench.py's recipe and data (AdamW, warm-up, planted signal words, 5% of the labels flipped) and its three
checkpoints are scored on N training x M test examples:
- reference: exact all-parameter TracIn in float64 by a naive loop of one backward pass per example through the
  Hugging Face forward (an independent computation);
- the engine's factored path (method factored) in fp32 and in bf16 (CPU autocast), unprojected (k = 0) and
  projected to k x k per layer, with the lean forward and, with --hf, with the full Hugging Face forward too;
- per checkpoint, the same at fp32 and bf16;
- "sign only": a ranking that keeps each exact score's sign and orders the scores within a sign at random, the
  agreement left when nothing but the sign is right.
The median |cosine| between training gradients says how nearly parallel they are.

Cases: `trained` (peak lr 5e-4: the model learns), `chance` (peak lr 5e-3: the model stays at chance, its
gradients nearly parallel) and, with --base-init, BERT-base's shape (hidden 768, 12 layers) at initialisation
(one checkpoint; takes a few minutes more).

    python benchmarks/tracin_faithfulness_cpu.py --out benchmarks/results/tracin_faithfulness_cpu.md
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from tracin_bench import SIZES, bert_adapter, checkpoint_accuracy, dataset  # noqa: E402

from gpuopt_tui.core.atomic import atomic_write_text  # noqa: E402
from gpuopt_tui.jobs.models.base import Adapter, Checkpoint  # noqa: E402
from gpuopt_tui.jobs.models.demo.train import TrainPlan  # noqa: E402
from gpuopt_tui.jobs.models.demo.train import train as train_model  # noqa: E402
from gpuopt_tui.jobs.tracin import TracInOptions, rank_correlation, select_parameters, tracin_scores  # noqa: E402
from gpuopt_tui.jobs.tracin.agreement import top_k_overlap  # noqa: E402

TOP_K = 10


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    hidden: int
    layers: int
    lr: float | None  # None: the initialisation, one checkpoint
    n_train: int
    n_test: int
    sizes: tuple[int, ...]  # k of the engine's rows (0 = unprojected)


CASES = {
    "trained": Case("trained", 128, 4, 5e-4, 128, 8, (0, 16, 32)),
    "chance": Case("chance", 128, 4, 5e-3, 128, 8, (0, 16, 32)),
    # unprojected rows would hold 32 x 110M numbers: projected only
    "base-init": Case("base-init", 768, 12, None, 32, 8, (16, 32)),
}


def build(case: Case, folder: Path) -> tuple[Adapter, list[Checkpoint], object, object, list[float]]:
    size = dataclasses.replace(
        SIZES["quick"],
        hidden=case.hidden,
        layers=case.layers,
        heads=case.hidden // 64 or 2,
        intermediate=4 * case.hidden,
    )
    size = dataclasses.replace(size, vocab=1000, seq=32)
    adapter = bert_adapter(case.name, size, torch.device("cpu"))
    fit = dataset(size, 1024, 2, adapter, 0.05)
    test = dataset(size, case.n_test, 3, adapter, 0.0)
    if case.lr is None:
        path = folder / "init.safetensors"
        save_file({k: v.contiguous() for k, v in adapter.model.state_dict().items()}, str(path))
        checkpoints = [Checkpoint(path, 1.0)]
    else:
        plan = TrainPlan(epochs=6, batch_size=64, lr=case.lr, checkpoint_epochs=(2, 4, 6))
        model = adapter.model

        def loss_fn(batch: dict[str, Tensor]) -> Tensor:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            return F.cross_entropy(logits, batch["labels"])

        records, _ = train_model(model, loss_fn, fit.tensors, fit.token_fields, plan, folder / "ckpt", seed=0)
        checkpoints = [Checkpoint(folder / r["file"], r["lr"]) for r in records]
    accuracy = checkpoint_accuracy(adapter, checkpoints, dataset(size, 512, 5, adapter, 0.0))
    return adapter, checkpoints, fit.head(case.n_train), test, accuracy


def naive(adapter: Adapter, checkpoints: list[Checkpoint], train, test) -> tuple[list[Tensor], list[float]]:
    """Per checkpoint: lr * exact float64 scores [n_test, n_train] (one backward per example, training examples
    streamed), and the median |cosine| between test and training gradients."""
    model = type(adapter.model)(adapter.model.config).double().eval()
    params = list(model.parameters())
    per, cosines = [], []
    for ckpt in checkpoints:
        state = {k: v.double() if v.is_floating_point() else v for k, v in load_file(str(ckpt.path)).items()}
        model.load_state_dict(state, strict=False)

        def grad(ds, i: int) -> Tensor:
            rows = {k: ds.tensors[k][i : i + 1] for k in ("input_ids", "attention_mask")}
            loss = F.cross_entropy(model(**rows).logits, ds.tensors["labels"][i : i + 1])
            return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])

        test_grads = torch.stack([grad(test, i) for i in range(len(test))])
        scores = torch.zeros(len(test), len(train), dtype=torch.float64)
        train_norms = torch.zeros(len(train), dtype=torch.float64)
        for j in range(len(train)):
            g = grad(train, j)
            scores[:, j], train_norms[j] = test_grads @ g, g.norm()
        norms = test_grads.norm(dim=1)[:, None] * train_norms[None]
        cosines.append(float((scores / norms).abs().median()))
        per.append(ckpt.lr * scores)
    return per, cosines


def agreement(ours: Tensor, ref: Tensor) -> tuple[float, float]:
    return rank_correlation(ours, ref.float()), top_k_overlap(ours, ref.float(), TOP_K)


def run_case(case: Case, hf: bool) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        began = time.perf_counter()
        adapter, checkpoints, train, test, accuracy = build(case, Path(tmp))
        per, cosines = naive(adapter, checkpoints, train, test)
        reference = sum(per)
        everything = select_parameters(adapter, {k: v[:1] for k, v in test.tensors.items()}, "all")
        lines = [
            "",
            f"### {case.name}: hidden {case.hidden}, {case.layers} layers, "
            + ("at initialisation" if case.lr is None else f"trained 6 epochs at peak lr {case.lr:g}")
            + f"; {case.n_train} training x {case.n_test} test examples",
            "",
            f"- held-out accuracy per checkpoint: {', '.join(f'{a:.3f}' for a in accuracy)}",
            f"- median |cosine| between test and training gradients per checkpoint: "
            f"{', '.join(f'{c:.3f}' for c in cosines)}",
            "",
            "| scores | forward | precision | k | Spearman vs exact | top-10 overlap |",
            "|---|---|---|---:|---:|---:|",
        ]
        forwards = ("lean", "Hugging Face") if hf else ("lean",)
        for forward in forwards:
            for precision in ("fp32", "bf16"):
                for k in case.sizes:
                    options = TracInOptions(method="factored", precision=precision, projection_in=k, projection_out=k)
                    if forward != "lean":  # the adapter's forward without the lean shortcut
                        adapter.logits_only = lambda: contextlib.nullcontext(False)  # type: ignore[method-assign]
                    result = tracin_scores(adapter, checkpoints, train, test, everything, options)
                    adapter.__dict__.pop("logits_only", None)
                    s, t = agreement(result.matrix, reference)
                    lines.append(f"| all checkpoints | {forward} | {precision} | {k} | {s:.4f} | {t:.3f} |")
        if len(checkpoints) > 1:
            for i, ckpt in enumerate(checkpoints):
                for precision in ("fp32", "bf16"):
                    for k in case.sizes:
                        options = TracInOptions(
                            method="factored", precision=precision, projection_in=k, projection_out=k
                        )
                        result = tracin_scores(adapter, [ckpt], train, test, everything, options)
                        s, t = agreement(result.matrix, per[i])
                        lines.append(f"| checkpoint {i + 1} | lean | {precision} | {k} | {s:.4f} | {t:.3f} |")
        gen = torch.Generator().manual_seed(0)
        sign_only = reference.sign() + 1e-3 * torch.rand(reference.shape, generator=gen, dtype=torch.float64)
        s, t = agreement(sign_only.float(), reference)
        lines.append(f"| sign only (random within a sign) | | | | {s:.4f} | {t:.3f} |")
        lines += ["", f"({time.perf_counter() - began:.0f} s)"]
        print("\n".join(lines), flush=True)
        return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="trained,chance", help=f"comma list of {', '.join(CASES)}")
    parser.add_argument("--base-init", action="store_true", help="add the BERT-base-shaped case (minutes more)")
    parser.add_argument("--hf", action="store_true", help="also run the engine with the full Hugging Face forward")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = [c for c in args.cases.split(",") if c] + (["base-init"] if args.base_init else [])
    lines = [
        "# What makes projected TracIn disagree with exact TracIn (CPU)",
        "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- torch {torch.__version__}; exact reference: float64, one backward per example, Hugging Face forward",
        "- Spearman, top-10 overlap: per test example across training examples, mean over test examples",
    ]
    for name in names:
        lines += run_case(CASES[name], args.hf)
    if args.out:
        atomic_write_text(args.out, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
