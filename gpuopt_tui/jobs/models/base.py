"""The interface between the engines and a model: the `Adapter`.

Every engine (Integrated Gradients, TracIn, layer probing) talks to a model only through an `Adapter`, so the
same engine runs on a Hugging Face classifier, the built-in demo models and users' own models.

Batches
-------
A batch is a `dict[str, Tensor]` in which *every* tensor has the example dimension first (N), so engines can
slice (`select_rows`), move (`to_device`) and tile (`tile_rows`) a batch without knowing its keys:

- ``input_ids``      long  [N, *input_shape]  the tokens that are attributed / scored
- ``attention_mask`` long  [N, *input_shape]  1 for real tokens, 0 for padding
- ``labels``         long  [N]                 target class (for a two-tower model: the clicked candidate)
- adapter-specific extras, e.g. the two-tower demo's ``history_ids`` / ``history_mask`` [N, H, seq].

``input_shape`` is ``(seq_len,)`` for sequence classifiers (``Adapter.input_rank == 1``) and
``(n_candidates, seq_len)`` for the two-tower recommender (``input_rank == 2``); the last dimension is always
the token dimension. ``Adapter.token_fields`` maps every token-aligned key to the mask that says which of its
last-dimension positions are real, which is what `gpuopt_tui.jobs.data.trim_batch` uses to cut padding.

Integrated Gradients
--------------------
Attribution is over the *word* embeddings (position/type embeddings and LayerNorm come after them inside the
model), so IG over ``inputs_embeds`` equals layer IG on ``word_embeddings()``::

    ctx = adapter.encode_context(batch)                    # once per batch, no grad needed
    emb = adapter.word_embeddings()(batch["input_ids"])    # [N, *input_shape, hidden]
    base = adapter.word_embeddings()(baseline_ids)         # e.g. special_ids.pad everywhere
    # interpolate step-major: row k*N+i = step k of example i
    x = base.repeat(...) + alphas * (emb - base).repeat(...)
    out = adapter.logits_from_embeds(x, tile_rows(batch["attention_mask"], k), tile_rows(ctx, k))

`encode_context` holds the part of the computation that does not depend on the attributed tokens (the
two-tower model's user vector from the reading history): computed once per batch instead of once per
interpolation step. Its tensors have first dimension N too; tile them with `tile_rows` to match the
interpolated rows. Models keep their parameters in fp32; wrap forwards in `jobs.device.autocast` for AMP.

TracIn
------
Per-example gradients go through `functional_loss`, which runs the model with
`torch.func.functional_call`, so `torch.func.vmap(torch.func.grad(...))` works::

    params = {n: p.detach() for n, p in adapter.model.named_parameters() if n in chosen}
    def one(p, example):                            # example: a batch row, first dim removed by vmap
        row = {k: v.unsqueeze(0) for k, v in example.items()}
        return adapter.functional_loss(p, row)[0]
    grads = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0))(params, batch)   # {name: [N, *shape]}

Parameters missing from the dict passed to `functional_logits` / `functional_loss` fall back to the module's
own tensors (`strict=False`). `checkpoints` lists the demo's saved training checkpoints with their learning
rates; `load_weights(path)` loads any state dict (safetensors or a torch file) into `model`, in two halves that
may run apart: `read_weights(path)` (disk to CPU memory only, safe in a background thread: TracIn reads the
next checkpoint while the current one is scored) and `apply_weights(state, path)`.
`classifier_head()` names the final Linear layer (for the last-layer closed form), when the model has one.

Probing
-------
`hidden_states(batch)` returns one tensor per layer, embeddings output first, each
``[N, *input_shape, hidden]``; pool them with ``batch["attention_mask"]``.

Errors a user can fix (missing files, bad factories, wrong shapes in their data) raise
`gpuopt_tui.core.errors.UserError`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpuopt_tui.core.errors import UserError

if TYPE_CHECKING:
    from gpuopt_tui.core.profiles.common import DataSection
    from gpuopt_tui.jobs.data import Row, TextDataset

Batch = dict[str, Tensor]


@dataclass(frozen=True)
class SpecialIds:
    """Ids of the tokenizer's special tokens; None where the tokenizer has no such token."""

    pad: int | None
    mask: int | None
    cls: int | None
    sep: int | None
    unk: int | None

    @classmethod
    def of(cls, tokenizer: Any) -> SpecialIds:
        return cls(
            pad=tokenizer.pad_token_id,
            mask=tokenizer.mask_token_id,
            cls=tokenizer.cls_token_id,
            sep=tokenizer.sep_token_id,
            unk=tokenizer.unk_token_id,
        )

    def non_content(self) -> set[int]:
        """Ids that are structure rather than text (excluded from token rankings)."""
        return {i for i in (self.pad, self.cls, self.sep) if i is not None}


@dataclass(frozen=True)
class Checkpoint:
    """A saved state dict and the learning rate in force when it was saved."""

    path: Path
    lr: float


# --- batch helpers -------------------------------------------------------------------------------------------
def to_device(batch: Mapping[str, Tensor], device: torch.device) -> Batch:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def select_rows(batch: Mapping[str, Tensor], index: Tensor | Sequence[int] | slice) -> Batch:
    """The examples at `index` (a slice, a list of row numbers or an index tensor)."""
    if not isinstance(index, (slice, Tensor)):
        index = torch.as_tensor(list(index), dtype=torch.long)
    return {k: v[index.to(v.device) if isinstance(index, Tensor) else index] for k, v in batch.items()}


def tile_rows(tensors: Mapping[str, Tensor] | Tensor, times: int) -> Any:
    """Repeat the rows `times` times, step-major: row k*N+i is a copy of row i (IG's interpolation layout)."""
    if isinstance(tensors, Tensor):
        return tensors.repeat(times, *([1] * (tensors.dim() - 1)))
    return {k: tile_rows(v, times) for k, v in tensors.items()}


# --- the adapter ---------------------------------------------------------------------------------------------
class Adapter:
    """A model, its tokenizer and the calls the engines need. Subclasses implement `model_inputs` and
    `logits_from_embeds`; the rest has working defaults for single-sequence classifiers."""

    #: len(input_shape): 1 for [N, seq] classifiers, 2 for [N, n_candidates, seq] rankers.
    input_rank: int = 1

    def __init__(
        self,
        name: str,
        model: nn.Module,
        tokenizer: Any,
        num_labels: int,
        device: torch.device,
        *,
        label_names: Sequence[str] | None = None,
        checkpoints: Sequence[Checkpoint] = (),
        info: Mapping[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.num_labels = num_labels
        self.device = device
        self.label_names = list(label_names) if label_names else None
        #: Training checkpoints known to the adapter (the demo's); TracIn profiles may name their own.
        self.checkpoints = list(checkpoints)
        #: Facts about the model for reports and oracles (the demo: signal tokens, flipped train labels, ...).
        self.info: dict[str, Any] = dict(info or {})
        #: Token-aligned batch keys -> the mask key giving their real positions (see module docstring).
        self.token_fields: dict[str, str] = {"input_ids": "attention_mask"}
        self.special_ids = SpecialIds.of(tokenizer)
        #: The directory the weights were read from (hf, demo), whose files digests.py hashes; None: the weights
        #: are known only in memory.
        self.weights_dir: Path | None = None
        #: Names of the PEFT adapter's trainable parameters once `model` is wrapped in one for adapter checkpoints
        #: (see peft_adapters.py); None: the model is not wrapped, checkpoints are full state dicts.
        self.peft_trainable: list[str] | None = None
        #: What `loss_per_example` computes, for reports (TracIn's summary).
        self.loss_description = "cross-entropy of the label"

    # -- tokens ---------------------------------------------------------------------------------------------
    def word_embeddings(self) -> nn.Embedding:
        """The token embedding table whose output `logits_from_embeds` takes."""
        emb = self.model.get_input_embeddings()
        if not isinstance(emb, nn.Embedding):
            raise UserError(f"{self.name}: the model's input embeddings are not an nn.Embedding ({type(emb)})")
        return emb

    @property
    def max_positions(self) -> int:
        """Longest token sequence the model accepts."""
        config = getattr(self.model, "config", None)
        return int(getattr(config, "max_position_embeddings", 0) or 512)

    def tokenize(self, texts: Sequence[str], max_length: int) -> Batch:
        """`input_ids` and `attention_mask` [N, seq], right-padded to the longest text (at most `max_length`,
        capped by the model's position table); special tokens ([CLS] ... [SEP]) added as the model expects."""
        enc = self.tokenizer(
            list(texts),
            padding=True,
            truncation=True,
            max_length=min(max_length, self.max_positions),
            return_tensors="pt",
        )
        return {"input_ids": enc["input_ids"].long(), "attention_mask": enc["attention_mask"].long()}

    def tokens(self, ids: Sequence[int]) -> list[str]:
        """Token strings for display."""
        return self.tokenizer.convert_ids_to_tokens([int(i) for i in ids])

    # -- data ------------------------------------------------------------------------------------------------
    def builtin_dataset(self, split: str, data: DataSection | None = None) -> TextDataset:
        """The dataset that comes with the model (data source = demo). Only the demo adapters have one; `data` (the
        profile's [data] section) names the fields of a demo whose rows are read as a file's are (the causal LM's)."""
        raise UserError(f"data source = demo needs model adapter = demo; model {self.name} has no built-in data")

    def dataset_from_rows(self, rows: Sequence[Row], data: DataSection) -> TextDataset:
        """Turn parsed jsonl/csv rows into a dataset: reads `data.text_field` (and `data.label_field` when the
        rows have it). Adapters with other inputs (the two-tower model) override this."""
        from gpuopt_tui.jobs.data import text_dataset_from_rows

        return text_dataset_from_rows(self, rows, data)

    # -- forward passes ----------------------------------------------------------------------------------------
    def model_inputs(self, batch: Mapping[str, Tensor]) -> dict[str, Any]:
        """Keyword arguments for `self.model(...)` built from a batch."""
        raise NotImplementedError

    def functional_inputs(self, batch: Mapping[str, Tensor]) -> dict[str, Any]:
        """Like `model_inputs`, for `functional_logits`: inputs must not make the model branch on tensor
        values, which vmap cannot trace (the HF adapter passes a ready-made 4D attention mask)."""
        return self.model_inputs(batch)

    def logits_from_output(self, output: Any) -> Tensor:
        """[N, C] logits from what `self.model` returns (an HF output with `.logits`, or a tensor)."""
        return output if isinstance(output, Tensor) else output.logits

    def logits(self, batch: Mapping[str, Tensor]) -> Tensor:
        """Ordinary forward from token ids: [N, num_labels] (for a ranker: [N, n_candidates])."""
        return self.logits_from_output(self.model(**self.model_inputs(batch)))

    def functional_logits(self, params: Mapping[str, Tensor], batch: Mapping[str, Tensor]) -> Tensor:
        """`logits` with the given parameters/buffers swapped in (torch.func.functional_call; vmap-safe).
        Names not in `params` use the module's own tensors."""
        out = torch.func.functional_call(
            self.model, dict(params), args=(), kwargs=self.functional_inputs(batch), strict=False
        )
        return self.logits_from_output(out)

    def explained_outputs(self, spec: str, batch: Mapping[str, Tensor]) -> Tensor | None:
        """The output index per row that attribution.target = `spec` explains, where the adapter fixes it (a causal
        LM has one output); None: the engine resolves `spec` over the model's outputs."""
        return None

    def encode_context(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """What the forward needs besides the attributed tokens, computed once per batch (first dim N)."""
        return {}

    def token_mask(self, batch: Mapping[str, Tensor]) -> Tensor | None:
        """[N, *positions]: 1 at the real tokens of the sequence the model's per-token layers run on during
        `loss_per_example` (the attention mask by default; None: no padding)."""
        return batch.get("attention_mask")

    def step_mask(self, attention_mask: Tensor) -> Tensor | None:
        """The mask `logits_from_embeds` gets for the IG steps of a batch: the mask itself by default; None
        where the forward accepts it for "no padding" and the batch has none (attention then runs unmasked)."""
        return attention_mask

    def logits_only(self) -> contextlib.AbstractContextManager[bool]:
        """A block within which the engines read nothing but `logits`, `logits_from_embeds` and the losses:
        the model may skip work that cannot change them (yields whether it does). None by default."""
        return contextlib.nullcontext(False)

    def logits_from_embeds(
        self, inputs_embeds: Tensor, attention_mask: Tensor, context: Mapping[str, Tensor]
    ) -> Tensor:
        """Logits [N, C] from word embeddings [N, *input_shape, hidden] (instead of `input_ids`), the mask
        [N, *input_shape] and `encode_context`'s output tiled to N rows."""
        raise NotImplementedError

    # -- losses ----------------------------------------------------------------------------------------------
    def loss_from_logits(self, logits: Tensor, labels: Tensor) -> Tensor:
        """Per-example loss [N] in fp32; cross-entropy by default (override, e.g. BCE for a link scorer)."""
        return F.cross_entropy(logits.float(), labels, reduction="none")

    def loss_per_example(self, batch: Mapping[str, Tensor]) -> Tensor:
        return self.loss_from_logits(self.logits(batch), _labels(batch))

    def functional_loss(self, params: Mapping[str, Tensor], batch: Mapping[str, Tensor]) -> Tensor:
        """Per-example loss [N] with `params` swapped in (see the module docstring for vmap(grad))."""
        return self.loss_from_logits(self.functional_logits(params, batch), _labels(batch))

    # -- internals for probing and TracIn ----------------------------------------------------------------------
    def hidden_states(self, batch: Mapping[str, Tensor]) -> list[Tensor]:
        """One [N, *input_shape, hidden] tensor per layer, embedding output first."""
        out = self.model(**self.model_inputs(batch), output_hidden_states=True)
        return list(out.hidden_states)

    def classifier_head(self) -> tuple[str, nn.Linear] | None:
        """(module name, layer) of the final Linear producing the logits, or None if there is none."""
        return None

    def load_weights(self, path: Path) -> None:
        """Load a full state dict (.safetensors, or a torch file read with weights_only=True) into `model`, or
        where `model` is wrapped in a PEFT adapter, an adapter checkpoint's weights file.
        A "module." prefix (DistributedDataParallel) is dropped; extra entries for the model's buffers
        (e.g. position_ids, which older transformers saved) are ignored. The same as
        `apply_weights(read_weights(path), path)`."""
        self.apply_weights(self.read_weights(path), path)

    def read_weights(self, path: Path) -> dict[str, Tensor]:
        """The first half of `load_weights`, which only reads: the state dict of `path` in CPU memory,
        "module." prefix dropped, page-locked when the model is on a GPU (so that `apply_weights` queues its
        copies without waiting). Touches neither the model nor the GPU's work, so it may run in a background
        thread while the model is in use. UserError if the file is missing or unreadable."""
        state = load_state_dict(path)
        if state and all(k.startswith("module.") for k in state):
            state = {k[len("module.") :]: v for k, v in state.items()}
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):  # a new thread's current GPU is GPU 0, whatever the model's
                state = {k: v.pin_memory() for k, v in state.items()}
        return state

    def apply_weights(self, state: Mapping[str, Tensor], source: Path) -> None:
        """The second half of `load_weights`: load `state` (from `read_weights(source)`) into `model`;
        `source` names the file in errors. UserError if the names do not match the model's."""
        if self.device.type == "cuda":  # asynchronous copies from page-locked memory
            state = {k: v.to(self.device, non_blocking=True) for k, v in state.items()}
        if self.peft_trainable is not None:
            from gpuopt_tui.jobs.models.peft_adapters import load_adapter_state

            load_adapter_state(self, state, source)
            return
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        buffers = {name for name, _ in self.model.named_buffers()}
        unexpected = [k for k in unexpected if k not in buffers]
        if missing or unexpected:
            raise UserError(
                f"{source}: does not match model {self.name}: missing {_few(missing)}, unexpected {_few(unexpected)}"
            )

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Recompute activations in the backward pass to save memory (models that support it)."""
        if enabled and hasattr(self.model, "gradient_checkpointing_enable"):
            self.model.gradient_checkpointing_enable()
        elif not enabled and hasattr(self.model, "gradient_checkpointing_disable"):
            self.model.gradient_checkpointing_disable()

    def describe(self) -> str:
        params = sum(p.numel() for p in self.model.parameters())
        n = torch.get_num_threads()
        threads = f" ({n} thread{'s' if n > 1 else ''})" if self.device.type == "cpu" else ""
        return f"{self.name}: {params / 1e6:.2f} M parameters, {self.num_labels} labels, on {self.device}{threads}"


def load_state_dict(path: Path) -> dict[str, Tensor]:
    """A state dict from a .safetensors file or a torch file (weights_only); UserError if unreadable."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: checkpoint file not found")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path), device="cpu")
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise UserError(f"{path}: cannot read the checkpoint ({exc})") from exc
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise UserError(f"{path}: expected a state dict (parameter name -> tensor)")
    return state


def _labels(batch: Mapping[str, Tensor]) -> Tensor:
    if "labels" not in batch:
        raise UserError("this computation needs labels, but the data has none (set data.label_field)")
    return batch["labels"]


def _few(names: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit]) or "none"
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")
