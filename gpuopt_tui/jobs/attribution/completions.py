"""Attribution runs on causal language models: the completions, read or generated before the run, and the results
per sample after it.

The engine explains one scalar per row: the log-probability of the row's completion given its prompt (sum over the
completion's tokens), or with `per_target_token` one completion token's own, a row per token. Integrated Gradients
is linear in the explained output, so a sample's whole-completion scores are the sum of its per-token rows (exact
for fixed steps; each row within its own tolerance for "auto" steps). The records keep the classifier layout
(`text` = the prompt, `tokens` and `scores` per prompt token, for the whole completion) and add `completion`,
`completion_tokens`, `logprob`, `generated` and, per token, `token_logprobs`, `token_deltas` and
`token_relative_deltas` (each row's convergence delta), `token_top` (each row's `top`) and `matrix` [completion,
prompt], in that order, last (the results index in core reads a line up to them). attributions.safetensors adds
`completion_ids` [N, T] (zero-padded), `completion_lengths` and `logprob` [N] and, per token, `token_logprobs`,
`token_deltas`, `token_relative_deltas` [N, T] and `matrix` [N, T, P] (zeros where a sample has fewer tokens).

What is not shared yet: the keys and values of the prompt cannot be reused across steps (the prompt is what moves
along the path; only at alpha = 1 is it the input's), and the per-token rows of a sample run the same forward at
every alpha, differing only in the output they explain: one forward with a backward pass per completion token
would do their work for less.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.attribution import AttributionSection, CompletionDataSection
from gpuopt_tui.jobs.attribution.deltas import relative_deltas
from gpuopt_tui.jobs.attribution.outputs import Collected, float32_value, float32_values, sample_records, sample_top
from gpuopt_tui.jobs.completion_data import (
    COMPLETIONS,
    SAMPLE_OF_ROW,
    completion_source,
    has_completions,
    missing_completions,
    per_token_rows,
    with_generated_completions,
)
from gpuopt_tui.jobs.context import StageFn
from gpuopt_tui.jobs.data import TextDataset
from gpuopt_tui.jobs.models import Adapter
from gpuopt_tui.jobs.models.causal_lm import CausalLMAdapter

OUTPUT = "log-probability of the completion given the prompt under teacher forcing (sum over its tokens)"
GENERATE_STAGE = "generating completions (greedy)"


@dataclass
class CompletionRun:
    """The samples of a causal LM run (one per prompt) and the rows the engine attributes."""

    samples: TextDataset
    rows: TextDataset  # the samples, or one row per (sample, completion token)
    source: str  # where the completions came from, in words
    per_token: bool
    rows_collected: Collected | None = None  # the per-token rows' own results, kept by `per_sample`

    def per_sample(self, collected: Collected) -> Collected:
        """The rows' results as one result per sample (per-token rows summed), with `probability` = the
        completion's probability, exp(log-probability)."""
        if self.per_token:
            self.rows_collected = collected
            collected = _summed(collected, self.rows.meta[SAMPLE_OF_ROW], self.samples)
        return dataclasses.replace(collected, probability=collected.scores.double().exp().float())

    def records(
        self,
        collected: Collected,
        to_tokens: Callable[[Sequence[int]], list[str]],
        structure_ids: set[int],
        top_k_sample: int,
    ) -> Iterator[dict[str, Any]]:
        """The JSONL records of the samples (the module docstring)."""
        ids, mask = self.samples.tensors["completion_ids"], self.samples.tensors["completion_mask"].bool()
        texts = self.samples.meta[COMPLETIONS]
        rows = self._rows_by_sample()
        generated = self.source.startswith("generated")
        records = sample_records(collected, self.samples.texts, to_tokens, structure_ids, top_k_sample)
        for i, record in enumerate(records):
            record |= {
                "completion": texts[i],
                "completion_tokens": to_tokens(ids[i][mask[i]].tolist()),
                "logprob": float32_value(collected.scores[i]),
                "generated": generated,
            }
            if self.rows_collected is not None:
                record |= self._per_token(self.rows_collected, i, rows[i], to_tokens, structure_ids, top_k_sample)
            yield record

    def _per_token(
        self,
        of_rows: Collected,
        i: int,
        rows: list[int],
        to_tokens: Callable[[Sequence[int]], list[str]],
        structure_ids: set[int],
        top_k_sample: int,
    ) -> dict[str, Any]:
        """Sample `i`'s per-token fields, from its `rows` (one per completion token) of the rows' results."""
        ids, mask = self.samples.tensors["input_ids"][i], self.samples.tensors["attention_mask"][i]
        return {
            "token_logprobs": float32_values(of_rows.scores[rows]),
            "token_deltas": float32_values(of_rows.deltas[rows]),
            "token_relative_deltas": float32_values(of_rows.relative_deltas[rows]),
            "token_top": [
                sample_top(ids, mask, of_rows.token_scores[r], to_tokens, structure_ids, top_k_sample) for r in rows
            ],
            "matrix": [float32_values(of_rows.token_scores[r][mask.bool()]) for r in rows],
        }

    def tensors(self, collected: Collected) -> dict[str, Tensor]:
        """The completions' tensors of attributions.safetensors (the module docstring), for `collected` per sample."""
        mask = self.samples.tensors["completion_mask"]
        tensors = {
            "completion_ids": self.samples.tensors["completion_ids"] * mask,
            "completion_lengths": mask.sum(1),
            "logprob": collected.scores.float(),
        }
        if self.rows_collected is None:
            return tensors
        rows = self.rows_collected
        sample, token = self.rows.meta[SAMPLE_OF_ROW], self.rows.tensors["target_position"]
        shape = mask.shape

        def per_token(values: Tensor) -> Tensor:
            out = torch.zeros(*shape, *values.shape[1:], dtype=torch.float32)
            out[sample, token] = values.float()
            return out

        return tensors | {
            "token_logprobs": per_token(rows.scores),
            "token_deltas": per_token(rows.deltas),
            "token_relative_deltas": per_token(rows.relative_deltas),
            "matrix": per_token(rows.token_scores),
        }

    def _rows_by_sample(self) -> list[list[int]]:
        if not self.per_token:
            return []
        grouped: list[list[int]] = [[] for _ in range(len(self.samples))]
        for row, sample in enumerate(self.rows.meta[SAMPLE_OF_ROW].tolist()):
            grouped[sample].append(row)
        return grouped

    def summary(self) -> dict[str, Any]:
        return {"output": OUTPUT, "source": self.source, "per_target_token": self.per_token}


def prepare_completions(
    adapter: Adapter, ds: TextDataset, data: CompletionDataSection, section: AttributionSection, stage: StageFn
) -> CompletionRun | None:
    """The completions of a causal LM run (None for other models, which have none to explain)."""
    if not isinstance(adapter, CausalLMAdapter):
        if section.per_target_token:
            raise UserError(
                f"attribution.per_target_token = true needs a causal language model; {adapter.name} is not one"
            )
        return None
    if section.target == "generate":
        stage(GENERATE_STAGE)
        ds = with_generated_completions(adapter, ds, section.max_new_tokens, section.batch_size)
        source = f"generated: the model's greedy continuation, up to {section.max_new_tokens} tokens"
    elif has_completions(ds):
        source = completion_source(data)
    else:
        raise UserError(
            f"{ds.origin}: no completions ({missing_completions(data)}); give them, or set "
            'attribution.target = "generate" to explain the model\'s own continuation'
        )
    rows = per_token_rows(ds) if section.per_target_token else ds
    return CompletionRun(ds, rows, source, section.per_target_token)


def _summed(collected: Collected, sample: Tensor, samples: TextDataset) -> Collected:
    """Per-token rows' results summed per sample (deltas and steps add up; the worst verdict and fallback count)."""
    n = len(samples)

    def add(values: Tensor) -> Tensor:
        return torch.zeros(n, *values.shape[1:], dtype=values.dtype).index_add_(0, sample, values)

    def worst(values: Tensor, reduce: str) -> Tensor:
        start = torch.zeros(n, dtype=values.dtype)
        return start.scatter_reduce(0, sample, values, reduce, include_self=False)

    scores, base = add(collected.scores), add(collected.baseline_scores)
    deltas = add(collected.deltas)
    zeros = torch.zeros(n, dtype=collected.target.dtype)
    return dataclasses.replace(
        collected,
        input_ids=samples.tensors["input_ids"],
        attention_mask=samples.tensors["attention_mask"],
        token_scores=add(collected.token_scores),
        deltas=deltas,
        relative_deltas=relative_deltas(deltas, scores, base),
        scores=scores,
        baseline_scores=base,
        target=zeros,
        prediction=zeros.clone(),
        margin=torch.full((n,), float("inf")),
        low_margin=torch.zeros(n, dtype=torch.bool),
        steps=add(collected.steps),
        fallback=worst(collected.fallback, "amax"),
        error=worst(collected.error, "amax"),
        within=None if collected.within is None else worst(collected.within.to(torch.uint8), "amin").bool(),
        labels=None,
    )
