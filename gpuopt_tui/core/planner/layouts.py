"""Where training frameworks keep the values a memory plan needs: one table of layouts, data rather than code.

A layout names the keys that identify it (`markers`), the sections its keys may sit under (`sections`: HF
TrainingArguments often sit under `training_args:` or `train:`), the keys of each role in the order they are
tried, and the framework's own defaults (HF Trainer trains in fp32 unless `bf16`/`fp16` is set; LLaMA-Factory
checkpoints activations and trains LoRA unless told otherwise). A key may translate its value (`means`): `bf16:
true` means bf16-mixed precision, `adapter: lora` means LoRA; a value the translation lacks says nothing and the
next key is tried. The first layout (in table order) one of whose markers the config holds is the one detected;
its keys are tried first, then the generic keys every layout shares.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

ANY = object()  # `means` key: any value found at the key


@dataclass(frozen=True)
class Key:
    path: str  # dotted, inside one of the layout's sections
    means: Mapping[Any, Any] | None = None  # found value (lower-cased text, or a bool) -> the role's value
    note: str = ""  # said whenever this key decides the role (an approximation the plan makes)

    def translate(self, value: Any) -> tuple[bool, Any]:
        """(whether the key decides the role, the value it means)."""
        if self.means is None or (isinstance(value, str) and "${" in value):  # an interpolation: said as it is
            return True, value
        if ANY in self.means:
            return True, self.means[ANY]
        found = value if isinstance(value, bool) else str(value).strip().lower()
        return (found in self.means), self.means.get(found)


@dataclass(frozen=True)
class Layout:
    name: str
    label: str  # as printed: "HF Trainer (TrainingArguments)"
    markers: tuple[str, ...]
    keys: Mapping[str, tuple[Key, ...]]
    sections: tuple[str, ...] = ("",)
    defaults: Mapping[str, Any] = field(default_factory=dict)  # the framework's own defaults, by role
    loop: str | None = None  # the training loop the framework runs (train_setup.LOOPS); None: unknown

    def candidates(self, role: str) -> tuple[Key, ...]:
        """Every key of `role` under every section, the layout's own first, then the generic keys."""
        own = tuple(
            Key(section + key.path, key.means, key.note) for key in self.keys.get(role, ()) for section in self.sections
        )
        shared = () if self is GENERIC else GENERIC.candidates(role)
        seen: set[str] = set()
        out = []
        for key in own + shared:
            if key.path not in seen:
                seen.add(key.path)
                out.append(key)
        return tuple(out)

    def detected(self, has_key: Callable[[str], bool]) -> bool:
        return any(has_key(section + marker) for marker in self.markers for section in self.sections)


def _keys(*paths: str, means: Mapping[Any, Any] | None = None, note: str = "") -> tuple[Key, ...]:
    return tuple(Key(p, means, note) for p in paths)


_ON = {True: True, False: False}
_HALF = (  # HF-style precision flags: bf16 / fp16 true, or both false (fp32)
    *_keys("bf16", "pure_bf16", means={True: "bf16-mixed"}),
    *_keys("fp16", means={True: "fp16-mixed"}),
    *_keys("bf16", "fp16", means={False: "fp32"}),
)
# Lightning's precision names (an int 16 or 32 in YAML reads as "16" / "32")
LIGHTNING_PRECISION = {
    "32": "fp32",
    "32-true": "fp32",
    "fp32": "fp32",
    "bf16": "bf16-mixed",
    "bf16-mixed": "bf16-mixed",
    "16": "fp16-mixed",
    "16-mixed": "fp16-mixed",
    "fp16": "fp16-mixed",
    "fp16-mixed": "fp16-mixed",
}
_DEEPSPEED_STAGES = {"deepspeed_stage_1": 1, "deepspeed_stage_2": 2, "deepspeed_stage_3": 3, "ddp": 0, "fsdp": 3}

# Keys every layout shares, tried after a layout's own (and the only ones when no layout is detected).
GENERIC = Layout(
    name="generic",
    label="no known layout (generic keys)",
    markers=(),
    keys={
        "model": _keys(
            "model_name_or_path",
            "pretrained_model_name_or_path",
            "model.model_name_or_path",
            "model.pretrained_model_name_or_path",
            "model.name_or_path",
            "model_args.model_name_or_path",
        ),
        "batch_size": _keys(
            "data_loader.batch_size",
            "data.batch_size",
            "datamodule.batch_size",
            "dataloader.batch_size",
            "training.batch_size",
            "train.batch_size",
            "batch_size",
        ),
        "accumulate": _keys(
            "training.trainer.accumulate_grad_batches",
            "trainer.accumulate_grad_batches",
            "training.accumulate_grad_batches",
            "train.accumulate_grad_batches",
            "accumulate_grad_batches",
            "training.gradient_accumulation_steps",
            "train.gradient_accumulation_steps",
            "gradient_accumulation_steps",
        ),
        "seq_len": _keys(
            "data.max_length",
            "data_loader.max_length",
            "data.max_seq_length",
            "data.max_seq_len",
            "training.max_seq_length",
            "training.max_length",
            "train.max_seq_length",
            "train.max_length",
            "model.max_length",
            "tokenizer.max_length",
            "max_length",
            "max_seq_length",
        ),
        "precision": _keys(
            "training.trainer.precision",
            "trainer.precision",
            "training.precision",
            "train.precision",
            "precision",
            means=LIGHTNING_PRECISION,
        ),
        "devices": _keys("training.trainer.devices", "trainer.devices"),
        "gradient_checkpointing": _keys(
            "model.gradient_checkpointing",
            "training.gradient_checkpointing",
            "train.gradient_checkpointing",
            "gradient_checkpointing",
            means=_ON,
        ),
        "zero_stage": (
            *_keys("training.trainer.strategy", "trainer.strategy", means=_DEEPSPEED_STAGES),
            *_keys("deepspeed.zero_optimization.stage", "zero_optimization.stage", "zero_stage"),
        ),
        "trainable": _keys("model.lora.enabled", "lora.enabled", means={True: "lora", False: "all"}),
        "lora_rank": _keys("model.lora.r", "lora.r", "model.lora.rank", "lora.rank"),
        "lora_targets": _keys("model.lora.target_modules", "lora.target_modules"),
        "n_positives": _keys("data.n_positives", "data_loader.n_positives", "training.n_positives", "n_positives"),
        "n_negatives": _keys("data.n_negatives", "data_loader.n_negatives", "training.n_negatives", "n_negatives"),
    },
)

LAYOUTS: tuple[Layout, ...] = (
    Layout(
        name="axolotl",
        label="axolotl",
        loop="hf",
        markers=("base_model", "micro_batch_size", "sequence_len"),
        keys={
            "model": _keys("base_model"),
            "batch_size": _keys("micro_batch_size"),
            "accumulate": _keys("gradient_accumulation_steps"),
            "seq_len": _keys("sequence_len"),
            "precision": (*_keys("bf16", means={True: "bf16-mixed", "auto": "bf16-mixed"}), *_HALF),
            "gradient_checkpointing": _keys("gradient_checkpointing", means={**_ON, "unsloth": True, "offload": True}),
            "trainable": (
                *_keys("adapter", means={"lora": "lora"}),
                *_keys(
                    "adapter",
                    means={"qlora": "lora"},
                    note="qlora: the 4-bit base weights are planned as 16-bit ones (an over-estimate)",
                ),
            ),
            "lora_rank": _keys("lora_r"),
            "lora_targets": (
                *_keys("lora_target_linear", means={True: ("all-linear",)}),
                *_keys("lora_target_modules"),
            ),
        },
        defaults={"precision": "fp32", "accumulate": 1, "gradient_checkpointing": False, "trainable": "all"},
    ),
    Layout(
        name="llama_factory",
        label="LLaMA-Factory",
        loop="hf",
        markers=("cutoff_len", "finetuning_type"),
        keys={
            "model": _keys("model_name_or_path"),
            "batch_size": _keys("per_device_train_batch_size"),
            "accumulate": _keys("gradient_accumulation_steps"),
            "seq_len": _keys("cutoff_len"),
            "precision": _HALF,
            "gradient_checkpointing": _keys("disable_gradient_checkpointing", means={True: False, False: True}),
            "trainable": _keys("finetuning_type", means={"lora": "lora", "full": "all", "freeze": "frozen_encoder"}),
            "lora_rank": _keys("lora_rank"),
            "lora_targets": _keys("lora_target"),
        },
        # LLaMA-Factory's own defaults: LoRA rank 8 on all linears, activations checkpointed, batch 8
        defaults={
            "precision": "fp32",
            "accumulate": 1,
            "batch_size": 8,
            "gradient_checkpointing": True,
            "trainable": "lora",
            "lora_rank": 8,
            "lora_targets": ("all-linear",),
        },
    ),
    Layout(
        name="torchtune",
        label="torchtune",
        loop="plain",
        markers=("model._component_", "tokenizer._component_", "checkpointer._component_"),
        keys={
            "model": _keys("checkpointer.checkpoint_dir"),
            "batch_size": _keys("batch_size"),
            "accumulate": _keys("gradient_accumulation_steps"),
            "seq_len": _keys("tokenizer.max_seq_len"),
            "precision": (
                *_keys(
                    "dtype",
                    means={"bf16": "bf16-mixed"},
                    note="torchtune trains in pure bf16; planned as bf16 mixed precision (fp32 master weights)",
                ),
                *_keys("dtype", means={"fp32": "fp32"}),
            ),
            "gradient_checkpointing": _keys("enable_activation_checkpointing", means=_ON),
            "trainable": _keys("model.lora_rank", means={ANY: "lora"}),
            "lora_rank": _keys("model.lora_rank"),
            "lora_targets": _keys("model.lora_attn_modules"),
        },
        defaults={"accumulate": 1, "gradient_checkpointing": False, "trainable": "all"},
    ),
    Layout(
        name="hf_trainer",
        label="HF Trainer (TrainingArguments)",
        loop="hf",
        markers=("per_device_train_batch_size", "model_name_or_path", "output_dir"),
        sections=(
            "",
            "training_args.",
            "training_arguments.",
            "training.",
            "train.",
            "trainer.",
            "args.",
            "model_args.",
        ),
        keys={
            "model": _keys("model_name_or_path"),
            "batch_size": _keys("per_device_train_batch_size"),
            "accumulate": _keys("gradient_accumulation_steps"),
            "seq_len": _keys("max_seq_length", "model_max_length", "max_length", "block_size"),
            "precision": _HALF,
            "gradient_checkpointing": _keys("gradient_checkpointing", means=_ON),
            "trainable": _keys("use_peft", means={True: "lora", False: "all"}),
            "lora_rank": _keys("lora_r"),
            "lora_targets": _keys("lora_target_modules"),
        },
        # TrainingArguments' own defaults
        defaults={
            "precision": "fp32",
            "batch_size": 8,
            "accumulate": 1,
            "gradient_checkpointing": False,
            "trainable": "all",
        },
    ),
    Layout(
        name="lightning",
        label="Lightning + Hydra",
        loop="lightning",
        markers=("trainer.accumulate_grad_batches", "trainer.precision", "trainer.devices", "trainer.max_epochs"),
        sections=("", "training."),
        keys={},
        defaults={"precision": "fp32", "accumulate": 1, "devices": 1},  # Lightning's Trainer defaults
    ),
    Layout(
        name="curriculum",
        label="curriculum (training./data. sections, samples per anchor)",
        markers=("n_positives", "n_negatives", "training.max_seq_length", "training.batch_size"),
        sections=("", "data.", "data_loader.", "training."),
        keys={},
    ),
)


def detect(has_key: Callable[[str], bool]) -> Layout:
    """The first layout one of whose markers the config holds, else GENERIC."""
    return next((layout for layout in LAYOUTS if layout.detected(has_key)), GENERIC)
