"""The TracIn run: checkpoints x training set x test set from a profile, resumable, with result files.

Result files (in results/):
- influence.jsonl: one line per test example: index, text, label, the model's `prediction` at the last
  checkpoint with its `probability` and the label's (`label_probability`), and its top_k `proponents` and
  `opponents` (training index, score, text, label). For a causal LM, each example (and neighbour) has its
  `completion` beside its prompt (`text`), no label and no prediction, and the test example the loss of its
  completion at the last checkpoint (`completion_loss`).
- self_influence.jsonl and self_influence.csv: every scored training example ranked by self-influence
  sum_c lr_c * ||g_c||^2, highest first (mislabeled examples tend to rank high).
- dataset_ranking.jsonl and dataset_ranking.csv: every scored training example ranked by its mean influence over
  the test examples (the query set), highest first, with its max influence over them (`mean_influence`,
  `max_influence`, `n_queries`, its index, text, completion or label): the training subset to keep for the query
  set's task is a top slice of it (`gpuopt-tui select` prints or exports the top k or top p%, by mean or max).
- scores.safetensors: the full [n_test, n_scored] score matrix (NaN where the filter skipped a pair) with the
  scored training indices, when n_test * n_train <= save_matrix_max.
- summary.json: settings, the loss TracIn differentiates (`loss`), where a causal LM's completions were read from
  (`completions`: e.g. 'data.target_field = "completion"'; null for other models), what preconditioned the
  training gradients (`optimizer_state`: null for plain gradients; for Adam the formula and each checkpoint's
  optimizer file, β1, β2, ε and step), parameter count, timing, the label names (null when the model has none), the
  checkpoint the predictions come from, and for the demo the flipped-label AUC of self-influence.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from gpuopt_tui.core.atomic import write_atomically, write_csv, write_json, write_jsonl
from gpuopt_tui.core.caches.gradients import default_root
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.schema import to_plain
from gpuopt_tui.core.profiles.tracin import TracInProfile
from gpuopt_tui.core.results.tracin import (
    DATASET_CSV_NAME,
    DATASET_JSONL_NAME,
    INFLUENCE_NAME,
    MATRIX_NAME,
    SELF_CSV_NAME,
    SELF_JSONL_NAME,
    SUMMARY_NAME,
)
from gpuopt_tui.core.results.tracin_summary import optimizer_state
from gpuopt_tui.jobs.completion_data import COMPLETIONS, completion_source, has_completions, missing_completions
from gpuopt_tui.jobs.context import PREPARE_STAGE, WRITE_STAGE, JobContext, ResumePart, StageFn
from gpuopt_tui.jobs.data import TextDataset, cut_texts_note, load_dataset, trim_batch
from gpuopt_tui.jobs.device import amp_dtype_supported, precision, resolve_device
from gpuopt_tui.jobs.digests import file_digest, input_parts, model_origin
from gpuopt_tui.jobs.models import Adapter, Checkpoint, load_adapter, to_device
from gpuopt_tui.jobs.models.peft_adapters import adapter_config
from gpuopt_tui.jobs.tracin.adam_state import DESCRIPTION, optimizer_files
from gpuopt_tui.jobs.tracin.checkpoints import PEFT_ADAPTER, STATE_DICT, resolve_checkpoints
from gpuopt_tui.jobs.tracin.dataset_ranking import ranking_records
from gpuopt_tui.jobs.tracin.factored import module_uses
from gpuopt_tui.jobs.tracin.faithfulness import exact_agreement, precision_advice, projection_advice
from gpuopt_tui.jobs.tracin.filters import get_filter
from gpuopt_tui.jobs.tracin.interface import InfluenceResult, Reporter, TopK, TracInOptions
from gpuopt_tui.jobs.tracin.params import resolved_layers, select_parameters
from gpuopt_tui.jobs.tracin.scores import TracInRun, attempt_figures

PREDICTIONS_SHARD = "test_predictions"
SCORING_SHARD = "scoring.json"  # the batch size and rate of the last attempt that computed gradients


class ContextReporter(Reporter):
    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        self.last_stage = ""  # of the last progress reported: said again as the run ends
        self._first_done: int | None = None  # the count the first report had (a resumed run starts above 0)

    def progress(self, done: int, total: int, stage: str) -> None:
        self.last_stage = stage
        if self._first_done is None:
            self._first_done = done
        elif done > self._first_done:
            self.ctx.first_batch_done()  # before the progress, whose new stage would start a stage of its own
        self.ctx.progress(done, total, unit="train gradients", stage=stage)

    def stage(self, name: str) -> None:
        self.ctx.stage(name)

    def event(self, type: str, **fields: Any) -> None:
        self.ctx.event(type, **fields)

    def warn(self, message: str) -> None:
        self.ctx.warn(message)

    def check_cancelled(self) -> None:
        self.ctx.check_cancelled()


class ContextStore:
    """Shards as safetensors files in the run's state directory (written atomically)."""

    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx

    def has(self, name: str) -> bool:
        return self.ctx.shard_done(name)

    def load(self, name: str) -> dict[str, Tensor] | None:
        return load_file(str(self.ctx.shard_path(name))) if self.has(name) else None

    def save(self, name: str, tensors: dict[str, Tensor]) -> None:
        self.ctx.save_shard(name, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp)))

    def delete(self, name: str) -> None:
        self.ctx.delete_shard(name)


def run_job(profile: TracInProfile, ctx: JobContext) -> dict[str, Any]:
    section = profile.tracin
    device = resolve_device(profile.run.device)
    adapter = load_adapter(profile.model, device, ctx.cache_dir, ctx.stage)
    train, test = _datasets(profile, adapter, ctx.stage)
    for ds in (test, train):
        if note := cut_texts_note(ds, profile.data, adapter):
            ctx.log(note)
    ctx.stage(PREPARE_STAGE)
    checkpoints = resolve_checkpoints(section.checkpoints, adapter)
    probe = to_device(trim_batch(test.batch([0]), test.token_fields), device)
    names = select_parameters(adapter, probe, section.layers, section.n_last_layers, section.layer_names)
    layers, chosen_by = resolved_layers(adapter, section.layers)
    ctx.log(f"parameters that count: {layers} ({len(names)} tensors; {chosen_by})")
    inputs = input_parts(profile.model, adapter, [train, test], ctx.cache_dir)
    options = TracInOptions(
        method=section.method,
        precision=_precision(ctx, device, section.use_amp, section.amp_dtype),
        projection_dim=section.projection_dim,
        projection_in=section.projection_in,
        projection_out=section.projection_out,
        projection_basis=section.projection_basis,
        pca_examples=section.pca_examples,
        train_cache=default_root() if section.train_cache else None,
        seed=profile.run.seed,
        optimizer_state=section.optimizer_state,
        batch_size=section.batch_size,
        gradient_checkpointing=section.gradient_checkpointing,
        cleanup_every=section.cleanup_every,
        shard_size=section.shard_size,
        top_k=section.top_k,
        keep_matrix=len(test) * len(train) <= section.save_matrix_max,
        adapter_base=_adapter_base(adapter, checkpoints, inputs),
    )
    _check_plan(ctx, profile, options, names, checkpoints, inputs)
    saved = [name for name in ctx.finished_shards() if name.startswith("tracin_c")]
    if saved and ctx.rank == 0:
        ctx.log(f"resuming: {len(saved)} finished (checkpoint, block) shards found")
    with adapter.logits_only() as lean:  # only asks whether the model qualifies
        lean = lean and not options.gradient_checkpointing
    if excluded := _excluded(adapter, names, section.method):
        shown = [f"{name} ({why})" for name, why in list(excluded.items())[:4]]
        ctx.log(
            f"method = factored leaves out {len(excluded)} parameter tensors it cannot differentiate exactly: "
            + "; ".join(shown)
            + (" ..." if len(excluded) > 4 else "")
        )
    ctx.log(
        f"{adapter.describe()}; {len(train)} training x {len(test)} test examples, {len(checkpoints)} checkpoints, "
        f"{len(names)} parameter tensors ({section.layers}), precision {options.precision}"
        + ("; last layer for the first token only (exact)" if lean else "")
    )
    ctx.log(f"training gradients: {_training_gradients(section.optimizer_state)}")
    reporter = ContextReporter(ctx)
    run = TracInRun(
        adapter,
        checkpoints,
        train,
        test,
        names,
        options,
        pair_filter=get_filter(section.filter),
        store=ContextStore(ctx),
        reporter=reporter,
    )
    rank_stats = ctx.dist.gather(run.compute(ctx.rank, ctx.world_size))  # returns once every rank is done
    if rank_stats is None:  # ranks other than 0 are done: rank 0 merges
        return {}
    scoring = _scoring(ctx, attempt_figures(rank_stats), len(checkpoints))  # kept before the merge
    ctx.stage("merging the blocks' scores")
    result = run.gather(rank_stats)
    if preconditioning := optimizer_state(result.stats["optimizer_state"]):
        ctx.log(f"training gradients: {preconditioning.text}")
    if section.agreement_train:
        own = dataclasses.replace(options, fitted_bases=run.fitted_bases)  # the subset scored with the run's directions
        result.stats["agreement"] = exact_agreement(
            adapter, checkpoints, train, test, names, own, section.agreement_train, ContextReporter(ctx)
        )
        ctx.log(f"agreement with exact TracIn ({result.stats['agreement']['reference']}): {result.stats['agreement']}")
        for advice in (
            precision_advice(result.stats["agreement"]),
            projection_advice(result.stats["agreement"], options),
        ):
            if advice:
                ctx.warn(advice)
    summary = _write_results(ctx, profile, adapter, train, test, checkpoints, result, scoring)
    ctx.repeat_progress(reporter.last_stage)  # run lists show the scoring's count, not the later stages'
    return summary


def _training_gradients(choice: str) -> str:
    """What the training gradients are, for the log before the scoring."""
    if choice == "adam":
        return f"{DESCRIPTION} (tracin.optimizer_state = adam)"
    return "plain gradients (tracin.optimizer_state = off)"


def _adapter_base(
    adapter: Adapter, checkpoints: list[Checkpoint], inputs: dict[str, ResumePart]
) -> dict[str, Any] | None:
    """With PEFT adapter checkpoints, the base model's weights digest and the adapter's configuration (None
    otherwise): the weights of each checkpoint are made of them too."""
    if adapter.peft_trainable is None:
        return None
    return {"weights": inputs["model"].value, "config": adapter_config(checkpoints[0].path)}


def _excluded(adapter: Adapter, names: list[str], method: str) -> dict[str, str]:
    return module_uses(adapter.model, names)[1] if method == "factored" else {}


def _datasets(profile: TracInProfile, adapter: Adapter, stage: StageFn) -> tuple[TextDataset, TextDataset]:
    section = profile.tracin
    test = load_dataset(profile.data, adapter, stage=stage).head(section.n_test)
    if section.train_path:
        train = load_dataset(profile.data, adapter, path=section.train_path, stage=stage)
    elif profile.data.source == "demo":
        train = load_dataset(profile.data, adapter, split="train", stage=stage)
    else:
        raise UserError("tracin.train_path: the training examples are needed (a jsonl or csv file)")
    train = train.head(section.n_train)
    for name, ds in (("test", test), ("training", train)):
        if len(ds) == 0:
            raise UserError(f"no {name} examples to score ({ds.origin})")
        if ds.labels is None and not has_completions(ds):
            raise UserError(
                f"the {name} examples ({ds.origin}) have no labels (for a causal LM: no completions, "
                f"{missing_completions(profile.data)}), which TracIn's loss needs"
            )
    return train, test


def _precision(ctx: JobContext, device: torch.device, use_amp: bool, amp_dtype: str) -> str:
    """The forward precision: autocast on the GPU when asked for, fp32 on the CPU."""
    if device.type != "cuda":
        return "fp32"
    chosen = precision(use_amp, amp_dtype)
    if not amp_dtype_supported(device, chosen):
        ctx.warn("this GPU has no bf16 support: using fp16 autocast instead")
        return "fp16"
    return chosen


def _check_plan(
    ctx: JobContext,
    profile: TracInProfile,
    options: TracInOptions,
    names: list[str],
    checkpoints: list[Checkpoint],
    inputs: dict[str, ResumePart],
) -> None:
    """Shards of an earlier attempt are reused only if they were made with the same settings, data, model,
    tokenizer (`inputs`) and checkpoints."""
    settings = {
        "method": options.method,
        "precision": options.precision,
        "projection_dim": options.projection_dim,
        "projection": [options.projection_in, options.projection_out],
        "seed": options.seed,
        "shard_size": options.shard_size,
        "filter": profile.tracin.filter,
        "processes": ctx.world_size,  # the blocks of training examples depend on it
        "parameters": names,
        **({"adapter_base": options.adapter_base} if options.adapter_base is not None else {}),
        **({"optimizer_state": options.optimizer_state} if options.optimizer_state != "off" else {}),
    }
    weights = [[file_digest(c.path, ctx.cache_dir), c.lr] for c in checkpoints]
    if options.optimizer_state == "adam":  # the training gradients depend on each checkpoint's optimizer state too
        states = optimizer_files(checkpoints)
        weights = [[*w, file_digest(f, ctx.cache_dir)] for w, f in zip(weights, states)]
    where = "tracin.checkpoints" if profile.tracin.checkpoints else model_origin(profile.model)
    ctx.check_resume_record(
        {
            **inputs,
            "checkpoints": ResumePart(weights, "the checkpoints", where),
            "settings": ResumePart(settings, "the settings"),
        }
    )


# --- results ----------------------------------------------------------------------------------------------------
def _write_results(
    ctx: JobContext,
    profile: TracInProfile,
    adapter: Adapter,
    train: TextDataset,
    test: TextDataset,
    checkpoints: list[Checkpoint],
    result: InfluenceResult,
    scoring: dict[str, Any],
) -> dict[str, Any]:
    """The result files; `scoring`: the batch size and rate of the scoring (see `_scoring`)."""
    section = profile.tracin
    files = {
        "influence": ctx.results_dir / INFLUENCE_NAME,
        "self_jsonl": ctx.results_dir / SELF_JSONL_NAME,
        "self_csv": ctx.results_dir / SELF_CSV_NAME,
        "dataset_jsonl": ctx.results_dir / DATASET_JSONL_NAME,
        "dataset_csv": ctx.results_dir / DATASET_CSV_NAME,
        "summary": ctx.results_dir / SUMMARY_NAME,
    }
    ctx.stage("predicting the test examples (last checkpoint)")
    predictions = _predictions(adapter, test, checkpoints[-1], section.batch_size, ContextStore(ctx))
    ctx.stage(WRITE_STAGE)
    flipped = _flipped(train)
    ranked = _self_influence_ranking(train, result, flipped)
    write_jsonl(files["influence"], _influence_records(train, test, result, predictions))
    write_jsonl(files["self_jsonl"], ranked)
    write_csv(files["self_csv"], ranked)
    ctx.artifact(files["influence"], "top proponents and opponents of each test example")
    ctx.artifact(files["self_jsonl"], "training examples ranked by self-influence")
    ctx.artifact(files["self_csv"], "training examples ranked by self-influence (CSV)")
    dataset = ranking_records(
        result.train_rows, result.query_mean, result.query_max, result.query_count, lambda i: _example(train, i)
    )
    write_jsonl(files["dataset_jsonl"], dataset)
    write_csv(files["dataset_csv"], dataset)
    ctx.artifact(files["dataset_jsonl"], "training examples ranked by mean influence over the test examples")
    ctx.artifact(files["dataset_csv"], "training examples ranked by mean influence over the test examples (CSV)")
    if result.matrix is not None:
        files["matrix"] = ctx.results_dir / MATRIX_NAME
        tensors = {
            "scores": result.matrix.float().contiguous(),
            "train_index": result.train_rows,
            "self_influence": result.self_influence.float(),
        }
        write_atomically(files["matrix"], lambda tmp: save_file(tensors, str(tmp)))
        ctx.artifact(files["matrix"], "full score matrix [n_test, n_scored] with the scored training indices")
    stats = result.stats
    timing = {k: v for k, v in scoring.items() if k != "final_batch_size"}
    rate = scoring["train_examples_per_s"]
    if rate is not None and len(result.train_rows):
        timing["train_tokens_per_s"] = rate * _mean_tokens(train, result.train_rows)
    auc = flipped_auc(result.self_influence, result.train_rows, flipped) if flipped is not None else None
    summary = {
        "model": adapter.describe(),
        "n_train": len(train),
        "n_test": len(test),
        "n_scored": stats["n_scored"],
        "train": train.origin,
        "test": test.origin,
        "checkpoints": [{"path": str(c.path), "lr": c.lr} for c in checkpoints],
        "checkpoint_kind": STATE_DICT if adapter.peft_trainable is None else PEFT_ADAPTER,
        "label_names": adapter.label_names,
        "loss": adapter.loss_description,
        "completions": completion_source(profile.data) if has_completions(test) else None,
        "predictions_checkpoint": str(checkpoints[-1].path),
        "settings": to_plain(section),
        "method": stats["method"],
        "precision": stats["precision"],
        "n_parameters": stats["n_parameters"],
        "parameter_tensors": stats["parameters"],
        "parameter_choice": dict(zip(("layers", "source"), resolved_layers(adapter, section.layers))),
        "gradient_size": stats["gradient_size"],
        "projection": _projection(section, profile.run.seed, len(train)),
        "optimizer_state": stats["optimizer_state"],
        "excluded_parameters": list(stats["excluded_parameters"]),  # the reasons are in the run's log
        "train_cache": stats["cache_blocks"],
        "agreement": stats.get("agreement"),
        "timing": {**timing, "processes": stats["processes"]},
        "oom_retries": stats["oom_retries"],
        "final_batch_size": scoring["final_batch_size"],
        "flipped_label_auc": auc,
        "top_self_influence": [entry["index"] for entry in ranked[:10]],
        "top_mean_influence": [entry["index"] for entry in dataset[:10]],
        "files": {k: p.name for k, p in files.items()},
    }
    write_json(files["summary"], summary)
    ctx.artifact(files["summary"], "settings, timing and summary figures")
    ctx.metric("train_examples_per_s", rate)
    if auc is not None:
        ctx.metric("flipped_label_auc", auc)
    preconditioning = optimizer_state(stats["optimizer_state"])
    return {
        "n_scored": stats["n_scored"],
        "train_examples_per_s": rate,
        # fitting PCA directions: seconds of the scoring that the rate leaves out
        **({"projection_fit_seconds": timing["projection_fit_seconds"]} if "projection_fit_seconds" in timing else {}),
        **({"flipped_label_auc": auc} if auc is not None else {}),  # only where the data marks flipped labels
        "training_gradients": preconditioning.text if preconditioning else _training_gradients("off"),
    }


def _mean_tokens(ds: TextDataset, rows: Tensor) -> float:
    """Real tokens per example among `rows`, every sequence of it counted (a causal LM's prompt and completion)."""
    masks = {mask for mask in ds.token_fields.values() if mask in ds.tensors}
    return sum(float(ds.tensors[mask][rows.cpu()].sum()) for mask in masks) / len(rows)


def _scoring(ctx: JobContext, figures: dict[str, Any], n_checkpoints: int) -> dict[str, Any]:
    """The micro-batch size and the rate of the scoring (`figures`: see scores.attempt_figures): this attempt's
    (kept as a shard), or where this attempt computed no gradient, the rate of reading them from the cache (as
    such), or (an earlier attempt had scored every block, then stopped) the last attempt's that did, with a note
    that says so."""
    if figures["computed"]:
        seconds, fitting = figures["seconds"], figures.get("fit_seconds", 0.0)
        scoring = {
            "final_batch_size": figures["final_batch_size"],
            "compute_seconds": seconds,
            # the rate leaves out fitting the PCA projection, a fixed cost that does not grow with the examples
            "train_examples_per_s": figures["computed"] / n_checkpoints / (seconds - fitting)
            if seconds > fitting
            else None,
            **({"projection_fit_seconds": fitting} if fitting else {}),
        }
        ctx.save_shard(SCORING_SHARD, lambda tmp: tmp.write_text(json.dumps(scoring), encoding="utf-8"))
        return scoring
    if figures["from_cache"]:  # a rate of reading, not of computing: said as such, none given as examples/s
        seconds = figures["seconds"]
        return {
            "final_batch_size": None,
            "compute_seconds": seconds,
            "train_examples_per_s": None,
            "cached_examples_per_s": figures["from_cache"] / n_checkpoints / seconds if seconds > 0 else None,
            "note": "every training gradient was read from the training-gradient cache (none computed)",
        }
    note = "no training gradient was computed by this attempt: every block's scores were saved by an earlier one"
    if ctx.shard_done(SCORING_SHARD):
        earlier = json.loads(ctx.shard_path(SCORING_SHARD).read_text(encoding="utf-8"))
        return {**earlier, "note": f"{note}, whose batch size and rate these are"}
    return {"final_batch_size": None, "compute_seconds": 0.0, "train_examples_per_s": None, "note": note}


def _projection(section: Any, seed: int, n_train: int) -> dict[str, Any] | None:
    """The projection the gradients went through (None: exact gradients); a PCA basis names the training examples
    it was fitted to (the first pca_examples of the `n_train`)."""
    if section.method == "factored" and (section.projection_in or section.projection_out):
        factored = {"kind": "factored", "in": section.projection_in, "out": section.projection_out, "seed": seed}
        if section.projection_basis == "pca":
            factored |= {"basis": "pca", "pca_examples": min(section.pca_examples, n_train)}
        return factored
    if section.method != "factored" and section.projection_dim:
        return {"kind": "dense", "dim": section.projection_dim, "seed": seed}
    return None


def _label(ds: TextDataset, i: int) -> int | None:
    return None if ds.labels is None else int(ds.labels[i])


def _completion(ds: TextDataset, i: int) -> dict[str, str]:
    """{"completion": the text} for a causal LM's example, else nothing."""
    return {"completion": ds.meta[COMPLETIONS][i]} if has_completions(ds) else {}


def _example(ds: TextDataset, i: int) -> dict[str, Any]:
    """An example's text, then its completion (a causal LM's) or its label."""
    return {"text": ds.texts[i], **(_completion(ds, i) if has_completions(ds) else {"label": _label(ds, i)})}


def _neighbours(train: TextDataset, top: TopK, i: int) -> list[dict[str, Any]]:
    return [
        {"index": r, "score": s, "text": train.texts[r], **_completion(train, r), "label": _label(train, r)}
        for r, s in zip(top.rows[i].tolist(), top.scores[i].tolist())
        if r >= 0
    ]


def _predictions(
    adapter: Adapter, test: TextDataset, checkpoint: Checkpoint, batch_size: int | str, store: ContextStore
) -> list[dict[str, Any]]:
    """Per test example: the class (a ranker: the candidate) the model at `checkpoint` predicts, its softmax
    probability and the probability of the example's label, from an fp32 forward; for a causal LM, the loss of its
    completion (`completion_loss`). Kept as a shard, so a resumed run loads no checkpoint again."""
    saved = store.load(PREDICTIONS_SHARD)
    if saved is None:
        adapter.load_weights(checkpoint.path)  # the scores may have come from shards without loading it
        step = batch_size if isinstance(batch_size, int) else 32
        parts = []
        with torch.inference_mode():
            for start in range(0, len(test), step):
                rows = list(range(start, min(start + step, len(test))))
                batch = to_device(trim_batch(test.batch(rows), test.token_fields), adapter.device)
                if has_completions(test):
                    parts.append(adapter.loss_per_example(batch).float().cpu())
                else:
                    parts.append(adapter.logits(batch).float().softmax(-1).cpu())
        saved = {"completion_loss" if has_completions(test) else "probabilities": torch.cat(parts)}
        store.save(PREDICTIONS_SHARD, saved)
    if "completion_loss" in saved:
        return [{"completion_loss": float(loss)} for loss in saved["completion_loss"]]
    probs = saved["probabilities"]
    out = []
    for i, row in enumerate(probs):
        best, label = int(row.argmax()), _label(test, i)
        out.append(
            {
                "prediction": best,
                "probability": float(row[best]),
                "label_probability": None if label is None else float(row[label]),
            }
        )
    return out


def _influence_records(
    train: TextDataset, test: TextDataset, result: InfluenceResult, predictions: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    return [
        {
            "index": i,
            "text": test.texts[i],
            **_completion(test, i),
            "label": _label(test, i),
            **predictions[i],
            "proponents": _neighbours(train, result.proponents, i),
            "opponents": _neighbours(train, result.opponents, i),
        }
        for i in range(len(test))
    ]


def _flipped(train: TextDataset) -> set[int] | None:
    """Training indices whose labels the demo flipped on purpose (None for other data)."""
    flipped = train.meta.get("flipped")
    return None if flipped is None else {int(i) for i in flipped if int(i) < len(train)}


def _self_influence_ranking(
    train: TextDataset, result: InfluenceResult, flipped: set[int] | None
) -> list[dict[str, Any]]:
    order = result.self_influence.argsort(descending=True, stable=True).tolist()
    rows = result.train_rows.tolist()
    ranked = []
    for rank, j in enumerate(order, 1):
        i = rows[j]
        entry = {
            "rank": rank,
            "index": i,
            "self_influence": float(result.self_influence[j]),
            "label": _label(train, i),
            "text": train.texts[i],
            **_completion(train, i),
        }
        if flipped is not None:
            entry["flipped"] = i in flipped
        ranked.append(entry)
    return ranked


def flipped_auc(self_influence: Tensor, rows: Tensor, flipped: set[int]) -> float | None:
    """Probability that a flipped example has higher self-influence than a clean one (ties count half)."""
    is_flipped = torch.tensor([int(r) in flipped for r in rows.tolist()], dtype=torch.bool)
    pos, neg = self_influence[is_flipped].double(), self_influence[~is_flipped].double()
    if not len(pos) or not len(neg):
        return None
    wins = sum(float((p > neg).sum() + 0.5 * (p == neg).sum()) for p in pos)
    return wins / (len(pos) * len(neg))
