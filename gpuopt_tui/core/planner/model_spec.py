"""Architecture numbers of a transformer from its Hugging Face config, computed without torch.

Supported families: BERT and RoBERTa, DistilBERT (encoders); GPT-2, and Llama-style decoders (Llama, Mistral,
Qwen2, Qwen3). Parameter counts are computed from the architecture, module by module, as transformers builds
it (biases, norms, tied embeddings, the task head), so they match `sum(p.numel())` of the built model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuopt_tui.core.errors import UserError

TASKS = ("classification", "causal_lm", "masked_lm", "embedding")
ENCODERS = ("bert", "roberta", "distilbert")
DECODERS = ("gpt2", "llama", "mistral", "qwen2", "qwen3")
SUPPORTED = ENCODERS + DECODERS
# Activation functions whose memory the estimate models op by op; others count as one fused op.
GELU_NEW = ("gelu_new",)


@dataclass(frozen=True)
class LinearSpec:
    """One linear module inside every layer, by its short name (what LoRA target lists match)."""

    name: str
    d_in: int
    d_out: int
    bias: bool


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a model; counts are per the whole model unless named per layer."""

    source: str  # where the numbers came from, for messages
    model_type: str
    task: str  # one of TASKS
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int  # MLP width (intermediate size)
    vocab: int
    max_positions: int
    num_labels: int
    activation: str
    gated_mlp: bool
    hidden_dropout: float
    tied_embeddings: bool
    layer_linears: tuple[LinearSpec, ...]
    embedding_params: int  # token, position and type embeddings and their norm
    layer_params: int  # one layer
    final_params: int  # final norm of pre-norm decoders
    head_params: int  # task head without tied weights

    @property
    def decoder(self) -> bool:
        return self.model_type in DECODERS

    @property
    def params(self) -> int:
        return self.embedding_params + self.layers * self.layer_params + self.final_params + self.head_params

    @property
    def layer_linear_params(self) -> int:
        return _linear_params(self.layer_linears)

    @property
    def head_linear_weights(self) -> int:
        """Weights of the head's linear layers that autocast casts to 16 bits (a tied LM head included)."""
        h, n = self.hidden, self.num_labels
        if self.task in ("causal_lm", "masked_lm"):
            transform = 0 if self.model_type in DECODERS else h * h
            return transform + self.vocab * h
        if self.task == "classification":
            pooled = 0 if self.model_type in DECODERS else h * h
            return pooled + h * n
        return h * h if self.model_type in ("bert", "roberta") else 0

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """Trainable LoRA parameters: rank x (d_in + d_out) for every targeted linear of every layer."""
        return self.layers * sum(rank * (lin.d_in + lin.d_out) for lin in self.lora_linears(targets))

    def lora_linears(self, targets: tuple[str, ...]) -> tuple[LinearSpec, ...]:
        names = {lin.name for lin in self.layer_linears}
        if "all-linear" in targets:
            return self.layer_linears
        unknown = [t for t in targets if t not in names]
        if unknown or not targets:
            raise UserError(
                f"LoRA targets {', '.join(unknown) or '(none)'} match no linear layer of this {self.model_type} "
                f"model; its layers have: {', '.join(sorted(names))} (or use all-linear)"
            )
        return tuple(lin for lin in self.layer_linears if lin.name in targets)


# --- reading configs -----------------------------------------------------------------------------------------


def load_config(path: str | Path) -> tuple[dict[str, Any], str]:
    """The config mapping from a model directory or a config.json file, and a label naming the file."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise UserError(f"{p}: no such file (expected a model directory with config.json, or a config.json)")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{p}: cannot read it as JSON: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"{p}: expected a JSON object (a Hugging Face config), got {type(data).__name__}")
    return data, str(p)


def spec_from_config(config: Mapping[str, Any], source: str = "config", task: str = "auto") -> ModelSpec:
    """The ModelSpec of a Hugging Face config mapping (config.json contents or `PretrainedConfig.to_dict()`)."""
    model_type = str(config.get("model_type", ""))
    if model_type not in SUPPORTED:
        got = f'model_type "{model_type}"' if model_type else "no model_type"
        raise UserError(
            f"{source}: {got}; the memory planner supports {', '.join(SUPPORTED)} configs "
            "(BERT, RoBERTa, DistilBERT, GPT-2 and Llama-style decoders)"
        )
    task = _task(config, model_type, task, source)
    reader = _Reader(config, source)
    if model_type in ("bert", "roberta"):
        return _bert(reader, model_type, task)
    if model_type == "distilbert":
        return _distilbert(reader, task)
    if model_type == "gpt2":
        return _gpt2(reader, task)
    return _llama(reader, model_type, task)


def _task(config: Mapping[str, Any], model_type: str, task: str, source: str) -> str:
    if task != "auto":
        if task not in TASKS:
            raise UserError(f'task "{task}": expected auto or one of {", ".join(TASKS)}')
        if (task == "masked_lm" and model_type in DECODERS) or (task == "causal_lm" and model_type == "distilbert"):
            raise UserError(f"{source}: task {task} does not exist for {model_type} models")
        return task
    return named_task(config) or ("causal_lm" if model_type in DECODERS else "classification")


def named_task(config: Mapping[str, Any]) -> str | None:
    """The task the model config's `architectures` name, or None when they name none the planner knows."""
    for arch in config.get("architectures") or ():
        name = str(arch)
        if name.endswith("ForSequenceClassification"):
            return "classification"
        if name.endswith("ForMaskedLM"):
            return "masked_lm"
        if name.endswith(("LMHeadModel", "ForCausalLM")):
            return "causal_lm"
        if name.endswith("Model"):
            return "embedding"
    return None


class _Reader:
    """Typed access to config keys with messages that name the key."""

    def __init__(self, config: Mapping[str, Any], source: str) -> None:
        self.config = config
        self.source = source

    def int(self, *keys: str, default: int | None = None) -> int:
        for key in keys:
            value = self.config.get(key)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise UserError(f"{self.source}: key '{key}' = {value!r}, expected a positive integer")
                return value
        if default is None:
            raise UserError(f"{self.source}: missing key '{keys[0]}' (a positive integer)")
        return default

    def float(self, key: str, default: float) -> float:
        value = self.config.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{self.source}: key '{key}' = {value!r}, expected a number")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.config.get(key, default)
        return default if value is None else bool(value)

    def str(self, key: str, default: str) -> str:
        value = self.config.get(key, default)
        return default if value is None else str(value)

    def num_labels(self) -> int:
        labels = self.config.get("id2label")
        if isinstance(labels, Mapping) and labels:
            return len(labels)
        return self.int("num_labels", default=2)


def _linear_params(linears: tuple[LinearSpec, ...]) -> int:
    return sum(lin.d_in * lin.d_out + (lin.d_out if lin.bias else 0) for lin in linears)


def _bert(r: _Reader, model_type: str, task: str) -> ModelSpec:
    h = r.int("hidden_size")
    heads = r.int("num_attention_heads")
    f = r.int("intermediate_size")
    v = r.int("vocab_size")
    positions = r.int("max_position_embeddings", default=512)
    types = r.int("type_vocab_size", default=2)
    linears = (
        LinearSpec("query", h, h, True),
        LinearSpec("key", h, h, True),
        LinearSpec("value", h, h, True),
        LinearSpec("dense", h, h, True),  # attention.output.dense
        LinearSpec("dense", h, f, True),  # intermediate.dense
        LinearSpec("dense", f, h, True),  # output.dense
    )
    layer = _linear_params(linears) + 2 * 2 * h  # two LayerNorms
    embeddings = (v + positions + types) * h + 2 * h
    labels = r.num_labels()
    tied = r.bool("tie_word_embeddings", True)
    if task == "classification":
        # BERT: pooler + classifier; RoBERTa: a two-layer head on the first token, no pooler
        head = h * h + h + h * labels + labels
    elif task in ("masked_lm", "causal_lm"):
        head = h * h + h + 2 * h + v + (0 if tied else v * h)  # transform, LayerNorm, decoder bias (+ weight)
    else:
        head = h * h + h  # the base model's pooler
    return ModelSpec(
        source=r.source,
        model_type=model_type,
        task=task,
        layers=r.int("num_hidden_layers"),
        hidden=h,
        heads=heads,
        kv_heads=heads,
        head_dim=h // heads,
        mlp=f,
        vocab=v,
        max_positions=positions,
        num_labels=labels,
        activation=r.str("hidden_act", "gelu"),
        gated_mlp=False,
        hidden_dropout=r.float("hidden_dropout_prob", 0.1),
        tied_embeddings=tied,
        layer_linears=linears,
        embedding_params=embeddings,
        layer_params=layer,
        final_params=0,
        head_params=head,
    )


def _distilbert(r: _Reader, task: str) -> ModelSpec:
    h = r.int("dim")
    heads = r.int("n_heads")
    f = r.int("hidden_dim")
    v = r.int("vocab_size")
    positions = r.int("max_position_embeddings", default=512)
    linears = (
        LinearSpec("q_lin", h, h, True),
        LinearSpec("k_lin", h, h, True),
        LinearSpec("v_lin", h, h, True),
        LinearSpec("out_lin", h, h, True),
        LinearSpec("lin1", h, f, True),
        LinearSpec("lin2", f, h, True),
    )
    labels = r.num_labels()
    tied = r.bool("tie_word_embeddings", True)
    if task == "classification":
        head = h * h + h + h * labels + labels  # pre_classifier + classifier
    elif task in ("masked_lm", "causal_lm"):
        head = h * h + h + 2 * h + v + (0 if tied else v * h)
    else:
        head = 0
    return ModelSpec(
        source=r.source,
        model_type="distilbert",
        task=task,
        layers=r.int("n_layers"),
        hidden=h,
        heads=heads,
        kv_heads=heads,
        head_dim=h // heads,
        mlp=f,
        vocab=v,
        max_positions=positions,
        num_labels=labels,
        activation=r.str("activation", "gelu"),
        gated_mlp=False,
        hidden_dropout=r.float("dropout", 0.1),
        tied_embeddings=tied,
        layer_linears=linears,
        embedding_params=(v + positions) * h + 2 * h,
        layer_params=_linear_params(linears) + 2 * 2 * h,
        final_params=0,
        head_params=head,
    )


def _gpt2(r: _Reader, task: str) -> ModelSpec:
    h = r.int("n_embd", "hidden_size")
    heads = r.int("n_head", "num_attention_heads")
    f = r.int("n_inner", default=4 * h)
    v = r.int("vocab_size")
    positions = r.int("n_positions", "max_position_embeddings", default=1024)
    linears = (
        LinearSpec("c_attn", h, 3 * h, True),
        LinearSpec("c_proj", h, h, True),
        LinearSpec("c_fc", h, f, True),
        LinearSpec("c_proj", f, h, True),
    )
    tied = r.bool("tie_word_embeddings", True)
    labels = r.num_labels()
    if task == "classification":
        head = h * labels  # score, no bias
    elif task in ("causal_lm", "masked_lm"):
        head = 0 if tied else v * h
    else:
        head = 0
    return ModelSpec(
        source=r.source,
        model_type="gpt2",
        task=task,
        layers=r.int("n_layer", "num_hidden_layers"),
        hidden=h,
        heads=heads,
        kv_heads=heads,
        head_dim=h // heads,
        mlp=f,
        vocab=v,
        max_positions=positions,
        num_labels=labels,
        activation=r.str("activation_function", "gelu_new"),
        gated_mlp=False,
        hidden_dropout=r.float("resid_pdrop", 0.1),
        tied_embeddings=tied,
        layer_linears=linears,
        embedding_params=(v + positions) * h,
        layer_params=_linear_params(linears) + 2 * 2 * h,
        final_params=2 * h,
        head_params=head,
    )


def _llama(r: _Reader, model_type: str, task: str) -> ModelSpec:
    h = r.int("hidden_size")
    heads = r.int("num_attention_heads")
    kv = r.int("num_key_value_heads", default=heads)
    d = r.int("head_dim", default=h // heads)
    f = r.int("intermediate_size")
    v = r.int("vocab_size")
    # Qwen2 always has q/k/v biases; Llama and Mistral follow attention_bias (o_proj too for Llama)
    qkv_bias = model_type == "qwen2" or r.bool("attention_bias", False)
    o_bias = model_type in ("llama", "qwen3") and r.bool("attention_bias", False)
    mlp_bias = model_type == "llama" and r.bool("mlp_bias", False)
    linears = (
        LinearSpec("q_proj", h, heads * d, qkv_bias),
        LinearSpec("k_proj", h, kv * d, qkv_bias),
        LinearSpec("v_proj", h, kv * d, qkv_bias),
        LinearSpec("o_proj", heads * d, h, o_bias),
        LinearSpec("gate_proj", h, f, mlp_bias),
        LinearSpec("up_proj", h, f, mlp_bias),
        LinearSpec("down_proj", f, h, mlp_bias),
    )
    qk_norms = 2 * d if model_type == "qwen3" else 0
    tied = r.bool("tie_word_embeddings", False)
    labels = r.num_labels()
    if task == "classification":
        head = h * labels
    elif task in ("causal_lm", "masked_lm"):
        head = 0 if tied else v * h
    else:
        head = 0
    return ModelSpec(
        source=r.source,
        model_type=model_type,
        task=task,
        layers=r.int("num_hidden_layers"),
        hidden=h,
        heads=heads,
        kv_heads=kv,
        head_dim=d,
        mlp=f,
        vocab=v,
        max_positions=r.int("max_position_embeddings", default=2048),
        num_labels=labels,
        activation=r.str("hidden_act", "silu"),
        gated_mlp=True,
        hidden_dropout=0.0,
        tied_embeddings=tied,
        layer_linears=linears,
        embedding_params=v * h,
        layer_params=_linear_params(linears) + 2 * h + qk_norms,
        final_params=h,
        head_params=head,
    )
