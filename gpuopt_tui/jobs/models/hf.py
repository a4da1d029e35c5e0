"""Local Hugging Face models (`from_pretrained(path)` only, never the hub): sequence classifiers here, causal LMs
in causal_lm.py (chosen by the architectures in config.json)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.context import StageFn, no_stage
from gpuopt_tui.jobs.models.base import Adapter
from gpuopt_tui.jobs.models.first_token import first_token_only

TRANSFORMERS_STAGE = "importing transformers"
WEIGHTS_STAGE = "reading the weights"
TOKENIZER_STAGE = "loading the tokenizer"


class SequenceClassifierAdapter(Adapter):
    """Any `AutoModelForSequenceClassification` model: logits [N, num_labels] from [N, seq] tokens."""

    def model_inputs(self, batch: Mapping[str, Tensor]) -> dict[str, Any]:
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    def functional_inputs(self, batch: Mapping[str, Tensor]) -> dict[str, Any]:
        mask = prepared_attention_mask(batch["attention_mask"], self.model)
        return {"input_ids": batch["input_ids"], "attention_mask": mask}

    def logits_from_embeds(
        self, inputs_embeds: Tensor, attention_mask: Tensor, context: Mapping[str, Tensor]
    ) -> Tensor:
        return self.model(inputs_embeds=inputs_embeds, attention_mask=attention_mask).logits

    def step_mask(self, attention_mask: Tensor) -> Tensor | None:
        return None if bool(attention_mask.all()) else attention_mask

    def logits_only(self) -> contextlib.AbstractContextManager[bool]:
        """BERT-style heads run a lean exact forward (first_token.py); a subclass whose logits read other
        positions must override this."""
        return first_token_only(self.model)

    def classifier_head(self) -> tuple[str, nn.Linear] | None:
        heads = [
            (name, mod)
            for name, mod in self.model.named_modules()
            if isinstance(mod, nn.Linear) and mod.out_features == self.num_labels
        ]
        return heads[-1] if heads else None


def prepared_attention_mask(mask: Tensor, model: nn.Module, visible: Tensor | None = None) -> Tensor:
    """The [N, 1, 1, seq] mask Hugging Face attention layers take once prepared (bool for SDPA, additive
    float for eager attention), built without looking at the values: transformers' own preparation branches
    on them (e.g. "no padding at all"), which torch.func.vmap cannot trace. `visible` [1, 1, q, seq] (bool): which
    keys each query may see besides (a causal model's), giving [N, 1, q, seq]."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None) or "eager"
    keep = mask[:, None, None, :].bool()
    if visible is not None:
        keep = keep & visible
    if impl == "sdpa":
        return keep
    if impl != "eager":  # flash-style kernels take the 2D mask only
        return mask
    dtype = next(model.parameters()).dtype
    return torch.zeros(keep.shape, dtype=dtype, device=mask.device).masked_fill(~keep, torch.finfo(dtype).min)


def quiet_progress_bars() -> None:
    """Turn off transformers' per-file progress bars, which would clutter run logs (warnings stay on)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_hf_adapter(path: Path, device: torch.device, stage: StageFn = no_stage) -> Adapter:
    """A sequence classifier, or a causal LM when config.json names a causal LM architecture, from the local model
    directory `path` on `device`; `stage` hears each step of a classifier's loading (their seconds are part of
    the run's start-up profile)."""
    if not path.is_dir():
        raise UserError(f"{path}: model directory not found (expected a local Hugging Face model directory)")
    if not (path / "config.json").is_file():
        raise UserError(f"{path}: no config.json (expected a directory written by save_pretrained)")
    stage(TRANSFORMERS_STAGE)
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from gpuopt_tui.jobs.models.causal_lm import is_causal_lm, load_causal_lm_adapter
    from gpuopt_tui.jobs.models.preloaded import read_model

    if is_causal_lm(path):
        return load_causal_lm_adapter(path, device)

    quiet_progress_bars()
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        import_model_class(config, stage)
        stage(WEIGHTS_STAGE)
        model = read_model(path, AutoModelForSequenceClassification, config=config)
    except Exception as exc:
        raise UserError(f"{path}: cannot load a sequence-classification model: {exc}") from exc
    stage(TOKENIZER_STAGE)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise UserError(f"{path}: cannot load the tokenizer saved with the model: {exc}") from exc
    check_tokenizer(path, tokenizer, model.get_input_embeddings().num_embeddings)
    stage(f"moving the model to {device}")
    labels = model.config.id2label
    names = [labels[i] for i in range(model.config.num_labels)] if labels else None
    adapter = SequenceClassifierAdapter(path.name, model, tokenizer, model.config.num_labels, device, label_names=names)
    adapter.weights_dir = path
    return adapter


def import_model_class(config: Any, stage: StageFn) -> None:
    """Import the transformers modules of the model's family now, at a stage of their own (transformers imports
    them on first use: a second or more, the largest part of loading a small model)."""
    from transformers import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

    stage(f"importing the model's transformers modules ({config.model_type})")
    with contextlib.suppress(KeyError):  # a family without one: from_pretrained says so
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING[type(config)]


def check_tokenizer(path: Path, tokenizer: Any, embedding_rows: int) -> None:
    """Refuse tokenizers that would silently give wrong tokens. Without tokenizer files transformers builds a
    tokenizer of special tokens only, which maps every word to [UNK]."""
    if len(tokenizer) <= len(set(tokenizer.all_special_ids)):
        raise UserError(
            f"{path}: no tokenizer vocabulary (found {len(tokenizer)} special tokens only); save the tokenizer "
            f'next to the model with tokenizer.save_pretrained("{path}")'
        )
    if tokenizer.vocab_size > embedding_rows:
        raise UserError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the model's embeddings have "
            f"{embedding_rows} rows; the tokenizer does not belong to this model"
        )
    if tokenizer.pad_token_id is None:
        raise UserError(f"{path}: the tokenizer has no padding token, which batching needs")
