"""Result files of an attribution run and the token rankings they hold.

- attributions.jsonl: one line per sample (dataset order): index, text, tokens, scores (one per real token;
  nested per candidate for two-tower inputs), target, label, prediction, probability, delta, relative_delta,
  margin (between the two largest outputs of the fp32 forward; null with one output), low_margin (that margin
  is within the error of the steps' precision: the steps may rank the two the other way), steps (the
  interpolation steps the sample used: its own with n_steps = "auto"), full_precision (its steps ran in TF32/fp32
  rather than the run's bf16/fp16: see the full_precision_fallback setting), and `top`: the
  sample's top_k_sample tokens by |score| as [position, token, score]. With n_steps = "auto" also
  error_estimate (the relative error estimate of its token scores), within_tolerance (its relative_delta and
  error_estimate are both within the tolerance: the engine's verdict) and full_precision_reason. Floats are
  written at full fp32 precision, each as the shortest decimal that reads back as the same fp32 value.
- attributions.safetensors: `scores` [N, *S] fp32 padded with zeros, `input_ids` [N, *S], `lengths`
  [N, *S[:-1]] (real tokens), and the per-sample `deltas`, `target`, `prediction`, `probability`, `margin`,
  `low_margin`, `steps`, `full_precision` and, with "auto" steps, `error_estimate` and `within_tolerance`; a causal
  LM's completions add theirs (attribution/completions.py).
- summary.json: the overall token ranking, delta statistics, settings and timing.

The overall ranking orders token strings by their mean *share* per occurrence: |attribution| divided by the
sample's total |attribution|, so that every sample has the same say whatever the size of its
F(x) - F(baseline). Tokens seen fewer than `min_count` times are left out (a single occurrence gives a noisy
mean). Each entry also lists the mean |attribution|, the mean signed attribution and the count. Structure
tokens ([CLS], [SEP], padding) and positions with exactly zero attribution (e.g. the candidates of a
two-tower input other than the explained one) are ranked neither overall nor per sample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch import Tensor

from gpuopt_tui.core.atomic import write_atomically
from gpuopt_tui.jobs.attribution.precision import FALLBACK_REASONS


@dataclass
class Collected:
    """Per-sample results in dataset order (N samples, S the dataset's padded input shape)."""

    input_ids: Tensor  # [N, *S]
    attention_mask: Tensor  # [N, *S]
    token_scores: Tensor  # [N, *S] fp32, zero on padding
    deltas: Tensor  # [N]
    relative_deltas: Tensor  # [N]
    scores: Tensor  # [N] F(x) of the target
    baseline_scores: Tensor  # [N] F(baseline) of the target
    target: Tensor  # [N]
    prediction: Tensor  # [N]
    probability: Tensor  # [N]
    margin: Tensor  # [N]
    low_margin: Tensor  # [N] bool
    steps: Tensor  # [N] interpolation steps used
    fallback: Tensor  # [N] int8: why its steps ran in full precision (precision.FALLBACK_REASONS; 0: they did not)
    error: Tensor  # [N] "auto" steps: the relative error estimate of its token scores (NaN with fixed steps)
    within: Tensor | None  # [N] bool, "auto" steps: its relative delta and error estimate are within the tolerance
    labels: Tensor | None  # [N]


def write_tensors(path: Path, collected: Collected, extra: Mapping[str, Tensor]) -> None:
    """attributions.safetensors: the tensors of `collected` (the module docstring) and `extra` (a causal LM's)."""
    mask = collected.attention_mask
    tensors = {
        "scores": collected.token_scores.float(),
        "input_ids": collected.input_ids.long(),
        "lengths": mask.sum(-1).long(),
        "deltas": collected.deltas.float(),
        "target": collected.target.long(),
        "prediction": collected.prediction.long(),
        "probability": collected.probability.float(),
        "margin": collected.margin.float(),
        "low_margin": collected.low_margin.bool(),
        "steps": collected.steps.long(),
        "full_precision": (collected.fallback > 0).bool(),
    }
    if collected.within is not None:
        tensors |= {"error_estimate": collected.error.float(), "within_tolerance": collected.within.bool()}
    tensors = {k: v.contiguous() for k, v in (tensors | dict(extra)).items()}
    write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "gpuopt-tui-ig-1"}))


def sample_records(
    collected: Collected,
    texts: Sequence[Any],
    to_tokens: Callable[[Sequence[int]], list[str]],
    structure_ids: set[int],
    top_k_sample: int,
) -> Iterator[dict[str, Any]]:
    """The JSONL records, one per sample (a generator: large runs are streamed to disk)."""
    for i in range(collected.input_ids.shape[0]):
        ids, mask, scores = collected.input_ids[i], collected.attention_mask[i], collected.token_scores[i]
        record: dict[str, Any] = {
            "index": i,
            "text": texts[i],
            "tokens": _nested(ids, mask, lambda row: to_tokens(row.tolist())),
            "scores": _nested(scores, mask, float32_values),
            "target": int(collected.target[i]),
            "label": None if collected.labels is None else int(collected.labels[i]),
            "prediction": int(collected.prediction[i]),
            "probability": float32_value(collected.probability[i]),
            "delta": float32_value(collected.deltas[i]),
            "relative_delta": float32_value(collected.relative_deltas[i]),
            "margin": float32_value(collected.margin[i]) if bool(collected.margin[i].isfinite()) else None,
            "low_margin": bool(collected.low_margin[i]),
            "steps": int(collected.steps[i]),
            "full_precision": bool(collected.fallback[i] > 0),
            **_verdict(collected, i),
            "top": sample_top(ids, mask, scores, to_tokens, structure_ids, top_k_sample),
        }
        yield record


def _verdict(collected: Collected, i: int) -> dict[str, Any]:
    """With "auto" steps: the sample's error estimate and whether it is within the tolerance (the engine's
    verdict, common.finish), and why its steps ran in full precision if they did."""
    if collected.within is None:
        return {}
    reason = int(collected.fallback[i])
    return {
        "error_estimate": float32_value(collected.error[i]),
        "within_tolerance": bool(collected.within[i]),
        "full_precision_reason": FALLBACK_REASONS[reason] if reason else None,
    }


def float32_values(values: Tensor) -> list[float]:
    """fp32 values as the Python floats whose repr is the shortest decimal that reads back as the same fp32
    value (e.g. 0.1 rather than 0.10000000149011612): JSON keeps every bit of fp32 without the noise digits.
    A decimal that lands on an fp32 rounding tie once read as a float64 keeps the exact value instead."""
    exact = values.detach().float().cpu().numpy().ravel()
    short = np.array([float(str(v)) for v in exact])
    return np.where(short.astype(np.float32) == exact, short, exact.astype(np.float64)).tolist()


def float32_value(value: Tensor) -> float:
    return float32_values(value.reshape(1))[0]


def _nested(values: Tensor, mask: Tensor, convert: Callable[[Tensor], list[Any]]) -> list[Any]:
    """Values at the real positions of one sample; a list per sequence when the sample has several."""
    if values.dim() == 1:
        return convert(values[mask.bool()])
    return [_nested(v, m, convert) for v, m in zip(values, mask)]


def sample_top(
    ids: Tensor,
    mask: Tensor,
    scores: Tensor,
    to_tokens: Callable[[Sequence[int]], list[str]],
    structure_ids: set[int],
    k: int,
) -> list[list[Any]]:
    """A sample's `k` tokens of largest |score| as [position, token, score] (structure tokens and zeros left out)."""
    rankable = _rankable(ids, mask, scores, structure_ids)
    positions = rankable.nonzero()
    values = scores[rankable]
    order = values.abs().argsort(descending=True)[:k]
    tokens = to_tokens(ids[rankable][order].tolist())
    top = []
    for j, token, value in zip(order.tolist(), tokens, float32_values(values[order])):
        pos = positions[j].tolist()
        top.append([pos[0] if len(pos) == 1 else pos, token, value])
    return top


def _rankable(ids: Tensor, mask: Tensor, scores: Tensor, structure_ids: set[int]) -> Tensor:
    structure = torch.tensor(sorted(structure_ids), dtype=ids.dtype)
    return mask.bool() & ~torch.isin(ids, structure) & (scores != 0)


def token_ranking(
    collected: Collected,
    to_tokens: Callable[[Sequence[int]], list[str]],
    structure_ids: set[int],
    k: int,
    min_count: int,
) -> list[dict[str, Any]]:
    """The top `k` token strings by mean share of their sample's |attribution| (see the module docstring)."""
    scores = collected.token_scores.double()
    totals = scores.abs().reshape(scores.shape[0], -1).sum(1).clamp_min(1e-30)
    shares = scores.abs() / totals.view(-1, *([1] * (scores.dim() - 1)))
    keep = _rankable(collected.input_ids, collected.attention_mask, scores, structure_ids)
    ids, scores, shares = collected.input_ids[keep], scores[keep], shares[keep]
    if ids.numel() == 0:
        return []
    size = int(ids.max()) + 1
    count = torch.bincount(ids, minlength=size)
    denominator = count.clamp_min(1)
    mean_share = torch.bincount(ids, weights=shares, minlength=size) / denominator
    mean_abs = torch.bincount(ids, weights=scores.abs(), minlength=size) / denominator
    mean = torch.bincount(ids, weights=scores, minlength=size) / denominator
    mean_share[count < max(1, min_count)] = -1.0
    top = [int(i) for i in mean_share.argsort(descending=True)[:k] if mean_share[i] >= 0]
    names = to_tokens(top)
    return [
        {
            "token": name,
            "id": i,
            "mean_share": float(mean_share[i]),
            "mean_abs": float(mean_abs[i]),
            "mean": float(mean[i]),
            "count": int(count[i]),
        }
        for i, name in zip(top, names)
    ]
