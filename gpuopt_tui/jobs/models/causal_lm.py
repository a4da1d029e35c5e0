"""Causal language models (`AutoModelForCausalLM`): the log-probability of a completion given a prompt.

Batches of a causal LM hold the prompt as the attributed tokens and the completion beside it:

- ``input_ids`` / ``attention_mask``       [N, P]  the prompt, tokenized with the tokenizer's special tokens (or
  through its chat template), padded on either side
- ``completion_ids`` / ``completion_mask`` [N, T]  the completion, tokenized without special tokens, right-padded
- ``target_position``                      [N]     -1: the output is the whole completion's log-probability; t: the
  log-probability of completion token t alone (one row of a [completion, prompt] matrix)

The forward (`logits_from_embeds`) runs the model on [prompt | completion] with each row's real tokens moved to
its front (a gather, which the gradients go back through) and its padding, of either part, after them. Causal
attention never lets a real token see a later position, so padding last changes nothing a real token computes and
the model runs without an attention mask: plain causal attention, which the fast kernels (flash) take, where a mask
with holes would need the memory-efficient kernel, and which also holds for models that ignore attention masks
(state-space layers). Each completion token is scored by the logits at the real position before it (teacher
forcing); the output [N, 1] is the sum of the chosen tokens' log-probabilities. Integrated Gradients then
interpolates the prompt's word embeddings only: the completion's embeddings travel as context, the same at every
step.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.attention import varied_length_kernels
from gpuopt_tui.jobs.models.base import Adapter, Batch, SpecialIds

if TYPE_CHECKING:
    from gpuopt_tui.core.profiles.common import DataSection
    from gpuopt_tui.jobs.data import Row, TextDataset

WHOLE_COMPLETION = -1  # target_position of a row that explains the whole completion


@dataclass(frozen=True)
class DecoderSpecialIds(SpecialIds):
    """A decoder tokenizer's special ids; every special token (BOS, EOS, chat-template markers) is structure."""

    structure: frozenset[int] = frozenset()

    def non_content(self) -> set[int]:
        return set(self.structure) | super().non_content()


def is_causal_lm(path: Path) -> bool:
    """Whether the model directory's config.json names a causal LM architecture (e.g. LlamaForCausalLM)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # the classifier loader reports what is wrong with the directory
    known = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return isinstance(config, dict) and any(name in known for name in config.get("architectures") or ())


class CausalLMAdapter(Adapter):
    """Any `AutoModelForCausalLM` model: one output per row, the (chosen tokens of the) completion's log-probability."""

    def __init__(self, name: str, model: nn.Module, tokenizer: Any, device: torch.device) -> None:
        super().__init__(name, model, tokenizer, 1, device, label_names=["log p(completion)"])
        self.loss_description = "mean token cross-entropy over the completion's tokens (prompt tokens masked)"
        self.token_fields = {"input_ids": "attention_mask", "completion_ids": "completion_mask"}
        self.special_ids = DecoderSpecialIds(**vars(SpecialIds.of(tokenizer)), structure=frozenset(_special(tokenizer)))
        #: set when the tokenizer had no padding token and padding borrows EOS (said in `describe`)
        self.borrowed_pad: str | None = None

    # -- tokens ---------------------------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str], max_length: int, *, chat: bool = False) -> Batch:
        """Prompts as `input_ids` / `attention_mask` [N, P], right-padded, with the tokenizer's special tokens; with
        `chat`, each text as a user message through the tokenizer's chat template (which writes its own)."""
        if chat:
            rendered = [self.chat_prompt([{"role": "user", "content": text}]) for text in texts]
            return self.tokenize_templated(rendered, max_length)
        return self._encode(texts, max_length, special=True)

    def tokenize_templated(self, prompts: Sequence[str], max_length: int) -> Batch:
        """Prompts rendered by `chat_prompt`, as `tokenize` gives them: no special tokens added (the template wrote
        its own)."""
        return self._encode(prompts, max_length, special=False)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], setting: str = "data.chat_template = true") -> str:
        """The tokenizer's chat template over `messages`, then the generation prompt (the assistant's turn begins),
        as text; `setting` says what asked for the template, in the error when the tokenizer has none."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise UserError(f"{setting}, but the tokenizer of {self.name} has no chat template")
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)

    def completions(self, texts: Sequence[str], max_length: int) -> Batch:
        """Completions as `completion_ids` / `completion_mask` [N, T], right-padded, without special tokens."""
        enc = self._encode(texts, max_length, special=False)
        return {"completion_ids": enc["input_ids"], "completion_mask": enc["attention_mask"]}

    def _encode(self, texts: Sequence[str], max_length: int, *, special: bool) -> Batch:
        enc = self.tokenizer(
            list(texts),
            padding=True,
            padding_side="right",  # trim_batch cuts trailing padding; the forward takes either side
            truncation=True,
            max_length=min(max_length, self.max_positions),
            add_special_tokens=special,
            return_tensors="pt",
        )
        return {"input_ids": enc["input_ids"].long(), "attention_mask": enc["attention_mask"].long()}

    # -- data ------------------------------------------------------------------------------------------------
    def dataset_from_rows(self, rows: Sequence[Row], data: DataSection) -> TextDataset:
        from gpuopt_tui.core.profiles.attribution import CompletionDataSection
        from gpuopt_tui.jobs.completion_data import completion_dataset_from_rows

        if not isinstance(data, CompletionDataSection):
            raise UserError(f"{self.name} is a causal LM: only attribution runs take one so far")
        return completion_dataset_from_rows(self, rows, data)

    # -- forward passes ----------------------------------------------------------------------------------------
    def model_inputs(self, batch: Mapping[str, Tensor]) -> dict[str, Any]:
        """The prompt alone (its hidden states); the explained output is `logits`'."""
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    def logits(self, batch: Mapping[str, Tensor]) -> Tensor:
        """[N, 1]: the explained log-probability of each row, from token ids."""
        with torch.no_grad():
            embeds = self.word_embeddings()(batch["input_ids"])
        return self.logits_from_embeds(embeds, batch["attention_mask"], self.encode_context(batch))

    def explained_outputs(self, spec: str, batch: Mapping[str, Tensor]) -> Tensor:
        """Output 0, the log-probability, for "predicted" (the data's completions) and "generate"."""
        if spec not in ("predicted", "generate"):
            raise UserError(
                f'attribution.target = "{spec}": {self.name} is a causal LM, which explains the log-probability of '
                'a completion: use "predicted" (the completions in data.target_field) or "generate"'
            )
        return torch.zeros(batch["input_ids"].shape[0], dtype=torch.long, device=batch["input_ids"].device)

    def encode_context(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The completion's embeddings, ids and mask, and each row's weight per completion token (1 where the row
        explains that token's log-probability)."""
        ids, mask = batch["completion_ids"], batch["completion_mask"]
        position = batch.get("target_position")
        weights = mask.clone()
        if position is not None:
            one = torch.arange(ids.shape[1], device=ids.device)[None, :] == position[:, None]
            weights = torch.where(position[:, None] == WHOLE_COMPLETION, weights, weights * one)
        with torch.no_grad():
            embeds = self.word_embeddings()(ids)
        return {"completion_embeds": embeds, "completion_ids": ids, "completion_mask": mask, "weights": weights}

    def logits_from_embeds(
        self, inputs_embeds: Tensor, attention_mask: Tensor | None, context: Mapping[str, Tensor]
    ) -> Tensor:
        """[N, 1]: sum over completion tokens of weight x log p(token | everything real before it)."""
        logits = self.next_token_logits(inputs_embeds, attention_mask, context)[:, :-1]
        ids = context["completion_ids"].long()[..., None]
        log_probs = (logits.gather(-1, ids) - logits.logsumexp(-1, keepdim=True)).squeeze(-1)
        return (log_probs * context["weights"].to(log_probs.dtype)).sum(1, keepdim=True)

    def next_token_logits(
        self,
        inputs_embeds: Tensor,
        attention_mask: Tensor | None,
        context: Mapping[str, Tensor],
        *,
        fixed_length: bool = False,
    ) -> Tensor:
        """[N, T + 1, V] (fp32 or wider): the logits predicting each completion token, and the token after them,
        computed at those positions only (`_output_layer_at`); `fixed_length`: see `completion_loss`."""
        completion = context["completion_embeds"].to(inputs_embeds.dtype)
        if attention_mask is None:
            attention_mask = torch.ones(inputs_embeds.shape[:2], dtype=torch.long, device=inputs_embeds.device)
        order, mask, before = sequence_layout(attention_mask, context["completion_mask"], trim=not fixed_length)
        embeds = torch.cat([inputs_embeds, completion], 1)
        embeds = embeds.gather(1, order[..., None].expand(-1, -1, embeds.shape[-1]))
        return self._logits_at(embeds, mask, before)

    def _logits_at(self, embeds: Tensor, mask: Tensor, before: Tensor) -> Tensor:
        """The model's logits at positions `before` [N, K] of the sequence `embeds` [N, L, hidden], whose padding
        (0 in `mask`) is last (`sequence_layout`): run with neither an attention mask nor position ids, so that
        transformers builds the model's own masks from the shapes alone (causal, and sliding windows where the model
        has them) and reads nothing from the values (torch.func.vmap traces it)."""
        with self._output_layer_at(before, mask.shape[1]) as gathered, varied_length_kernels(embeds.device):
            out = self.model(inputs_embeds=embeds, use_cache=False)
        logits = out.logits
        if not gathered[0]:
            logits = logits.gather(1, before[..., None].expand(-1, -1, logits.shape[-1]))
        return logits.to(torch.promote_types(logits.dtype, torch.float32))  # log-softmax over the vocabulary

    @contextlib.contextmanager
    def _output_layer_at(self, positions: Tensor, length: int) -> Iterator[list[bool]]:
        """Within the block, the model's output layer (`get_output_embeddings`) takes the hidden states at
        `positions` [N, K] only, gathered from its input [N, length, hidden]: the logits [N, K, V] of those positions
        alone are computed, not the whole sequence's (a large vocabulary's output layer is a good share of a forward
        and most of its memory). What the model does to the logits after that layer (soft-capping, scaling) is per
        position, so it stays the same. The gather has a fixed size, which torch.func.vmap runs; a layer's
        gradient through it is the same sum over the kept positions (the others' gradient is zero in every loss
        here). Yields [whether the layer ran on the gathered positions]: not when the model has no such layer or
        calls it on other shapes, and the caller gathers the logits instead."""
        head = self.model.get_output_embeddings()
        gathered = [False]
        if not isinstance(head, nn.Module):
            yield gathered
            return

        def gather(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            hidden = args[0] if args else None
            if not isinstance(hidden, Tensor) or hidden.dim() != 3 or hidden.shape[:2] != (len(positions), length):
                return None
            gathered[0] = True
            picked = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))
            return (picked, *args[1:])

        handle = head.register_forward_pre_hook(gather)
        try:
            yield gathered
        finally:
            handle.remove()

    # -- training loss (TracIn) -------------------------------------------------------------------------------
    def loss_per_example(self, batch: Mapping[str, Tensor]) -> Tensor:
        """[N] mean token cross-entropy over each row's completion tokens; the prompt's tokens are context only (not
        predicted: masked, as supervised fine-tuning trainers do). Every per-token layer runs once on the whole
        [prompt | completion] sequence (`token_mask`) but the output layer, which runs on the T + 1 positions that
        predict a completion token (and the one after); the padded ones among them get a zero gradient. The
        embeddings keep their graph and torch.func.vmap can run it (no value-dependent size)."""
        return self.completion_loss(batch, fixed_length=False)

    def completion_loss(self, batch: Mapping[str, Tensor], *, fixed_length: bool) -> Tensor:
        """`loss_per_example`; `fixed_length`: the sequence keeps the batch's P + T positions rather than its longest
        row's (a length read from the values, which torch.func.vmap cannot trace)."""
        order, mask, before = sequence_layout(batch["attention_mask"], batch["completion_mask"], trim=not fixed_length)
        ids = torch.cat([batch["input_ids"], batch["completion_ids"]], 1).gather(1, order)
        logits = self._logits_at(self.word_embeddings()(ids), mask, before)
        nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["completion_ids"].long(), reduction="none")
        weights = batch["completion_mask"].to(nll.dtype)
        return (nll * weights).sum(1) / weights.sum(1).clamp_min(1)

    def token_mask(self, batch: Mapping[str, Tensor]) -> Tensor:
        """[N, L]: the mask of the sequence `loss_per_example` runs (`sequence_layout`: real tokens first)."""
        return sequence_layout(batch["attention_mask"], batch["completion_mask"], trim=True)[1]

    def functional_loss(self, params: Mapping[str, Tensor], batch: Mapping[str, Tensor]) -> Tensor:
        """`loss_per_example` with `params` swapped in for the model's own."""
        named = {f"model.{name}": value for name, value in params.items()}
        return torch.func.functional_call(_LossOf(self), named, args=(dict(batch),), strict=False)

    # -- generation ------------------------------------------------------------------------------------------
    def generate(self, batch: Mapping[str, Tensor], max_new_tokens: int) -> Batch:
        """The model's greedy continuation of each prompt, up to `max_new_tokens` tokens and its first EOS (kept:
        stopping is the model's choice too), as `completion_ids` / `completion_mask` [N, T], right-padded. Each
        token is the argmax of the very forward that `logits_from_embeds` scores (no KV cache: one forward over
        prompt and continuation per new token)."""
        ids, mask = batch["input_ids"], batch["attention_mask"]
        table, eos = self.word_embeddings(), self.tokenizer.eos_token_id
        new = ids.new_zeros(ids.shape[0], 0)
        kept = new.clone()
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        with torch.no_grad():
            embeds = table(ids)
            for _ in range(max_new_tokens):
                context = {"completion_embeds": table(new), "completion_mask": kept}
                token = self.next_token_logits(embeds, mask, context)[:, -1].argmax(-1)
                new = torch.cat([new, torch.where(done, 0, token)[:, None]], 1)
                kept = torch.cat([kept, (~done).long()[:, None]], 1)
                if eos is not None:
                    done |= token == eos
                if bool(done.all()):
                    break
        return {"completion_ids": new, "completion_mask": kept}

    def describe(self) -> str:
        params = sum(p.numel() for p in self.model.parameters())
        pad = f"; padding borrows {self.borrowed_pad} (the tokenizer has no padding token)" if self.borrowed_pad else ""
        return f"{self.name}: {params / 1e6:.2f} M parameters, causal LM, on {self.device}{pad}"


class _LossOf(nn.Module):
    """The adapter's loss as a module over its model, for torch.func.functional_call."""

    def __init__(self, adapter: CausalLMAdapter) -> None:
        super().__init__()
        self.model = adapter.model
        self.adapter = adapter

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        return self.adapter.completion_loss(batch, fixed_length=True)


def sequence_layout(prompt_mask: Tensor, completion_mask: Tensor, *, trim: bool) -> tuple[Tensor, Tensor, Tensor]:
    """How [prompt | completion] (masks [N, P] and [N, T]) is laid out for the forward: (the order [N, L] that
    moves each row's real tokens first, in their order; the mask in that order, padding last; the position in that
    order predicting each completion token and the token after them [N, T + 1], the last real one at or before
    each such slot). `trim`: L is the longest row's real length, not P + T (a long prompt and another row's long
    completion need not meet in one row); a size that depends on the values, which torch.func.vmap cannot trace."""
    mask = torch.cat([prompt_mask.long(), completion_mask.long()], 1)
    before = previous_real_position(mask)[:, prompt_mask.shape[1] - 1 :]
    order = mask.sort(dim=1, descending=True, stable=True).indices
    before = order.argsort(1).gather(1, before)
    if trim:
        order = order[:, : max(1, int(mask.sum(1).max()))]
    return order, mask.gather(1, order), before


def _special(tokenizer: Any) -> list[int]:
    return [int(i) for i in tokenizer.all_special_ids if i is not None]


def previous_real_position(mask: Tensor) -> Tensor:
    """[N, L]: for each position, the last position at or before it whose mask is 1 (0 where there is none)."""
    index = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), index, 0).cummax(1).values


def load_causal_lm_adapter(path: Path, device: torch.device) -> CausalLMAdapter:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpuopt_tui.jobs.models.hf import check_tokenizer, quiet_progress_bars
    from gpuopt_tui.jobs.models.preloaded import read_model

    quiet_progress_bars()
    try:
        model = read_model(path, AutoModelForCausalLM)
    except Exception as exc:
        raise UserError(f"{path}: cannot load a causal language model: {exc}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise UserError(f"{path}: cannot load the tokenizer saved with the model: {exc}") from exc
    borrowed = None
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = borrowed = tokenizer.eos_token  # padding is masked out; only its id is needed
    check_tokenizer(path, tokenizer, model.get_input_embeddings().num_embeddings)
    adapter = CausalLMAdapter(path.name, model, tokenizer, device)
    adapter.borrowed_pad = borrowed
    adapter.weights_dir = path
    return adapter
