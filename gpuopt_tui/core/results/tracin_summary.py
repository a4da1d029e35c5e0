"""summary.json of a TracIn run (written by jobs/tracin/job.py), read without torch: checkpoints with their
learning rates, the parameters that counted and those a factored run left out, the gradient method and random
projection, the Adam preconditioning of the training gradients, the training-gradient cache's use, timing, the
label names and the checkpoint the predictions come from, the flipped-label AUC where the data marks flipped labels,
and the agreement with exact all-parameter TracIn where the run checked it. Keys added in later versions are
optional, so older runs still read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.results.record_fields import (
    RecordError,
    as_float,
    as_int,
    as_object,
    as_optional_float,
    as_text,
    as_texts,
    get_field,
)

METHOD_NAMES = {"closed_form": "closed form", "vmap": "vmap", "factored": "factored (all-layer hooks)"}


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    lr: float


@dataclass(frozen=True)
class Projection:
    """The projection the gradients went through: "factored" (each layer's input side to `size_in` and output side
    to `size_out` numbers; 0 = that side exact; seeded random directions, or with `pca_examples` directions fitted
    to the data) or "dense" (each parameter tensor to at most `dim` numbers, seeded random)."""

    kind: str
    seed: int | None  # None in runs older than the summary's "projection"
    size_in: int = 0
    size_out: int = 0
    dim: int = 0
    pca_examples: int = 0  # factored: its directions fitted to this many training examples (0: random ones)

    @property
    def text(self) -> str:
        if self.kind == "dense":
            return f"random projection to ≤{self.dim} numbers per tensor"

        def side(k: int) -> str:
            return str(k) if k else "exact"

        sides = f"each layer's gradient projected to {side(self.size_out)} × {side(self.size_in)} (output × input)"
        if self.pca_examples:
            sides += f", along its main directions over {self.pca_examples} training examples (PCA)"
        return sides


@dataclass(frozen=True)
class AdamFigures:
    """One checkpoint's Adam settings as the summary gives them: one value each, or (lowest, highest) where the
    parameters differ."""

    file: str
    beta1: float | tuple[float, float]
    beta2: float | tuple[float, float]
    eps: float | tuple[float, float]
    step: float | tuple[float, float]

    @property
    def settings(self) -> str:
        return f"β1 {_shown(self.beta1)}, β2 {_shown(self.beta2)}, ε {_shown(self.eps)}"

    @property
    def steps(self) -> str:
        return _shown(self.step)


def _shown(value: float | tuple[float, float]) -> str:
    return f"{value[0]:g}–{value[1]:g}" if isinstance(value, tuple) else f"{value:g}"


@dataclass(frozen=True)
class Preconditioning:
    """What the training gradients went through before the products: Adam's update direction Γ(g) from each
    checkpoint's optimizer state (`formula`), with each checkpoint's settings."""

    description: str
    formula: str
    checkpoints: tuple[AdamFigures, ...]

    @property
    def text(self) -> str:
        """The description with the settings, once where every checkpoint has the same betas and eps."""
        shared = {c.settings for c in self.checkpoints}
        if len(shared) == 1:
            return f"{self.description}: {shared.pop()}, step " + " / ".join(c.steps for c in self.checkpoints)
        return f"{self.description}: " + "; ".join(f"{c.settings}, step {c.steps}" for c in self.checkpoints)


@dataclass(frozen=True)
class CacheUse:
    """Blocks of training gradients (one per checkpoint and block of training examples) read from the cache and
    computed (and stored there) by the run."""

    read: int
    computed: int


@dataclass(frozen=True)
class Agreement:
    """This run's scores against exact all-parameter TracIn on its first `n_train` x `n_test` examples."""

    reference: str
    n_train: int
    n_test: int
    spearman: float  # mean over test examples of the rank correlation across training examples
    top_k: int
    top_k_overlap: float  # share of each test example's top_k training examples both agree on, averaged
    excluded_from_reference: tuple[str, ...] = ()
    #: the same settings in fp32, checked for runs with a bf16/fp16 forward: (Spearman, top-k overlap)
    fp32: tuple[float, float] | None = None


@dataclass(frozen=True)
class TracInSummary:
    """What summary.json says about a run (the figures the screen shows)."""

    model: str
    n_train: int
    n_test: int
    n_scored: int  # training examples scored (fewer than n_train only with a filter)
    checkpoints: tuple[CheckpointInfo, ...]
    method: str  # closed_form, vmap or factored
    projection_dim: int  # 0: exact gradients (closed_form, vmap)
    precision: str
    layers: str  # which parameters counted, as set in the profile
    filter: str
    n_parameters: int
    parameter_tensors: tuple[str, ...]
    gradient_size: int  # numbers per example gradient (after projection)
    compute_seconds: float | None
    train_examples_per_s: float | None
    train_tokens_per_s: float | None  # the same rate in real tokens (prompt and completion for a causal LM)
    oom_retries: int
    flipped_label_auc: float | None  # only where the data marks flipped labels
    label_names: tuple[str, ...] | None = None  # by class index; None when the model has none (or older runs)
    predictions_checkpoint: str = ""  # where the test predictions come from; "" in older runs
    cached_examples_per_s: float | None = None  # training gradients read from the cache a second, none computed
    projection_fit_seconds: float | None = None  # of compute_seconds, fitting PCA directions (not in the rate)
    projection: Projection | None = None  # None: exact gradients
    excluded_parameters: tuple[str, ...] = ()  # chosen tensors method = factored left out
    train_cache: CacheUse | None = None  # None: the cache was off
    agreement: Agreement | None = None  # None: not checked
    optimizer_state: Preconditioning | None = None  # None: plain training gradients

    def label_name(self, label: int | None) -> str:
        """A class as its name where the model names it, else its number ("-" for none)."""
        if label is None:
            return "-"
        names = self.label_names
        return names[label] if names and 0 <= label < len(names) else str(label)

    @property
    def mode(self) -> str:
        method = METHOD_NAMES.get(self.method, self.method)
        adam = ", Adam-preconditioned training gradients" if self.optimizer_state else ""
        return f"{method}, {self.projection.text if self.projection else 'exact gradients'}{adam}"


def _layers_text(settings: Mapping[str, Any], choice: Any) -> str:
    """Which parameters counted; where layers = auto chose them, what it chose and why (`choice`: the summary's
    parameter_choice, absent from older runs)."""
    layers = settings.get("layers")
    chosen = as_object(choice, "parameter_choice") if choice is not None else {}
    resolved = chosen.get("layers", layers)
    if resolved == "last":
        text = f"last {settings.get('n_last_layers')} modules"
    elif resolved == "names":
        text = "named: " + ", ".join(str(n) for n in settings.get("layer_names") or [])
    elif resolved == "adapter":
        text = "the PEFT adapter's trainable ones"
    else:
        text = str(resolved)
    return f"{text}; {chosen['source']}" if layers == "auto" and "source" in chosen else text


def _checkpoints(value: Any) -> tuple[CheckpointInfo, ...]:
    if not isinstance(value, list):
        raise RecordError("checkpoints: expected a list")
    out = []
    for i, c in enumerate(value):
        c = as_object(c, f"checkpoints[{i}]")
        path = as_text(get_field(c, "path"), f"checkpoints[{i}].path")
        out.append(CheckpointInfo(path, as_float(get_field(c, "lr"), f"checkpoints[{i}].lr")))
    return tuple(out)


def _projection(value: Any, projection_dim: int) -> Projection | None:
    """summary["projection"]; runs older than that key name only a dense projection, in the settings."""
    if value is None:
        return Projection("dense", None, dim=projection_dim) if projection_dim else None
    p = as_object(value, "projection")
    kind = as_text(get_field(p, "kind"), "projection.kind")
    seed = as_int(get_field(p, "seed"), "projection.seed")
    if kind == "dense":
        return Projection(kind, seed, dim=as_int(get_field(p, "dim"), "projection.dim"))
    if kind == "factored":
        size_in, size_out = as_int(get_field(p, "in"), "projection.in"), as_int(get_field(p, "out"), "projection.out")
        basis = p.get("basis", "random")
        if basis not in ("random", "pca"):
            raise RecordError(f"projection.basis: expected random or pca, found {basis!r}")
        fitted = as_int(get_field(p, "pca_examples"), "projection.pca_examples") if basis == "pca" else 0
        return Projection(kind, seed, size_in=size_in, size_out=size_out, pca_examples=fitted)
    raise RecordError(f"projection.kind: expected dense or factored, found {kind!r}")


def optimizer_state(value: Any) -> Preconditioning | None:
    """summary["optimizer_state"] (None: plain gradients, as in runs older than the key)."""
    if value is None:
        return None
    p = as_object(value, "optimizer_state")
    kind = as_text(get_field(p, "kind"), "optimizer_state.kind")
    if kind != "adam":
        raise RecordError(f"optimizer_state.kind: expected adam, found {kind!r}")
    found = get_field(p, "checkpoints")
    if not isinstance(found, list):
        raise RecordError("optimizer_state.checkpoints: expected a list")
    return Preconditioning(
        as_text(get_field(p, "description"), "optimizer_state.description"),
        as_text(get_field(p, "formula"), "optimizer_state.formula"),
        tuple(_adam_figures(c, f"optimizer_state.checkpoints[{i}]") for i, c in enumerate(found)),
    )


def _adam_figures(value: Any, where: str) -> AdamFigures:
    c = as_object(value, where)

    def figure(key: str) -> float | tuple[float, float]:
        found = get_field(c, key)
        if isinstance(found, list) and len(found) == 2:
            return as_float(found[0], f"{where}.{key}"), as_float(found[1], f"{where}.{key}")
        return as_float(found, f"{where}.{key}")

    file = as_text(get_field(c, "file"), f"{where}.file")
    return AdamFigures(file, figure("beta1"), figure("beta2"), figure("eps"), figure("step"))


def _cache_use(value: Any) -> CacheUse | None:
    if value is None:
        return None
    c = as_object(value, "train_cache")
    return CacheUse(
        as_int(get_field(c, "read"), "train_cache.read"), as_int(get_field(c, "computed"), "train_cache.computed")
    )


def _agreement(value: Any) -> Agreement | None:
    if value is None:
        return None
    a = as_object(value, "agreement")
    return Agreement(
        reference=as_text(get_field(a, "reference"), "agreement.reference"),
        n_train=as_int(get_field(a, "n_train"), "agreement.n_train"),
        n_test=as_int(get_field(a, "n_test"), "agreement.n_test"),
        spearman=as_float(get_field(a, "spearman"), "agreement.spearman"),
        top_k=as_int(get_field(a, "top_k"), "agreement.top_k"),
        top_k_overlap=as_float(get_field(a, "top_k_overlap"), "agreement.top_k_overlap"),
        excluded_from_reference=as_texts(a.get("excluded_from_reference", []), "agreement.excluded_from_reference"),
        fp32=_fp32_agreement(a.get("fp32")),
    )


def _fp32_agreement(value: Any) -> tuple[float, float] | None:
    if value is None:
        return None
    f = as_object(value, "agreement.fp32")
    # .get: a missing number is then named with its full key ("expected a number, found None")
    spearman = as_float(f.get("spearman"), "agreement.fp32.spearman")
    return spearman, as_float(f.get("top_k_overlap"), "agreement.fp32.top_k_overlap")


def parse_summary(data: Mapping[str, Any]) -> TracInSummary:
    settings = as_object(get_field(data, "settings"), "settings")
    timing = as_object(data.get("timing") or {}, "timing")
    projection_dim = as_int(settings.get("projection_dim", 0), "settings.projection_dim")
    names = data.get("label_names")
    return TracInSummary(
        model=as_text(get_field(data, "model"), "model"),
        n_train=as_int(get_field(data, "n_train"), "n_train"),
        n_test=as_int(get_field(data, "n_test"), "n_test"),
        n_scored=as_int(get_field(data, "n_scored"), "n_scored"),
        checkpoints=_checkpoints(get_field(data, "checkpoints")),
        method=as_text(get_field(data, "method"), "method"),
        projection_dim=projection_dim,
        precision=as_text(get_field(data, "precision"), "precision"),
        layers=_layers_text(settings, data.get("parameter_choice")),
        filter=str(settings.get("filter", "none")),
        n_parameters=as_int(get_field(data, "n_parameters"), "n_parameters"),
        parameter_tensors=as_texts(get_field(data, "parameter_tensors"), "parameter_tensors"),
        gradient_size=as_int(get_field(data, "gradient_size"), "gradient_size"),
        compute_seconds=as_optional_float(timing.get("compute_seconds"), "timing.compute_seconds"),
        train_examples_per_s=as_optional_float(timing.get("train_examples_per_s"), "timing.train_examples_per_s"),
        train_tokens_per_s=as_optional_float(timing.get("train_tokens_per_s"), "timing.train_tokens_per_s"),
        oom_retries=as_int(data.get("oom_retries", 0), "oom_retries"),
        flipped_label_auc=as_optional_float(data.get("flipped_label_auc"), "flipped_label_auc"),
        label_names=None if names is None else as_texts(names, "label_names"),
        predictions_checkpoint=as_text(data.get("predictions_checkpoint") or "", "predictions_checkpoint"),
        cached_examples_per_s=as_optional_float(timing.get("cached_examples_per_s"), "timing.cached_examples_per_s"),
        projection_fit_seconds=as_optional_float(timing.get("projection_fit_seconds"), "timing.projection_fit_seconds"),
        projection=_projection(data.get("projection"), projection_dim),
        excluded_parameters=as_texts(data.get("excluded_parameters") or [], "excluded_parameters"),
        train_cache=_cache_use(data.get("train_cache")),
        agreement=_agreement(data.get("agreement")),
        optimizer_state=optimizer_state(data.get("optimizer_state")),
    )


def read_summary(path: Path) -> TracInSummary:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not a readable summary ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    try:
        return parse_summary(data)
    except RecordError as e:
        raise UserError(f"{path}: {e}") from None
