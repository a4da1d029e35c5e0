"""Schema of a memory plan profile."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from gpuopt_tui.core.profiles.common import ModelSection, ProfileBase, RunSection
from gpuopt_tui.core.profiles.schema import opt, section

# A value set in the training config wins over the profile's; the command line wins over both.
_AUTO = "the training config's value wins over this one; auto:"
ROLES_HELP = (
    "model, batch_size, accumulate, seq_len, precision, trainable, lora_rank, lora_targets, gradient_checkpointing, "
    "devices, zero_stage, n_positives, n_negatives"
)


@dataclass
class PlanSection:
    config: str = opt("", "Training YAML config to read and update (empty = plan only)")
    overrides: list[str] = opt([], "Choices for a composed (Hydra-style) config, e.g. experiment=big")
    keys: list[str] = opt([], f"Where values sit in the config, as role=dotted.key (roles: {ROLES_HELP})")
    stages: list[str] = opt([], "Curriculum stage files, each with its own n_positives / n_negatives")
    task: str = opt(
        "auto",
        "What the model trains for (auto: from the model config's architectures)",
        choices=("auto", "classification", "causal_lm", "masked_lm", "embedding"),
    )
    precision: str = opt(
        "auto",
        f"Training precision ({_AUTO} bf16-mixed)",
        choices=("auto", "fp32", "bf16-mixed", "fp16-mixed"),
    )
    optimizer: str = opt("adamw", "Optimizer (sets state size)", choices=("adamw", "sgd", "adam8bit"))
    trainable: str = opt("auto", f"What trains ({_AUTO} all)", choices=("auto", "all", "frozen_encoder", "lora"))
    lora_rank: int | Literal["auto"] = opt("auto", f"LoRA rank, trainable = lora ({_AUTO} 8)", min=1)
    lora_targets: list[str] = opt(
        [],
        "LoRA's linear layers, by name or all-linear (the training config's win; empty: attention query, value)",
    )
    gradient_checkpointing: bool | Literal["auto"] = opt(
        "auto", f"Recompute activations in the backward pass ({_AUTO} off)"
    )
    seq_len: int | Literal["auto"] = opt("auto", f"Sequence length, worst case ({_AUTO} 128)", min=1)
    micro_batch: int | Literal["auto"] = opt("auto", f"Micro-batch to show ({_AUTO} 8)", min=1)
    accumulate: int | Literal["auto"] = opt("auto", f"Gradient accumulation steps ({_AUTO} 1)", min=1)
    effective_batch: int = opt(0, "Effective batch to keep via accumulation (0 = keep the config's)", min=0)
    accumulation: str = opt(
        "exact",
        "exact: a micro-batch dividing the effective batch; approx: the largest micro-batch, deviation shown",
        choices=("exact", "approx"),
    )
    n_positives: int | Literal["auto"] = opt("auto", f"Positive samples per anchor ({_AUTO} 0)", min=0)
    n_negatives: int | Literal["auto"] = opt("auto", f"Negative samples per anchor ({_AUTO} 0)", min=0)
    n_gpus: int | Literal["auto"] = opt("auto", f"GPUs, data parallel ({_AUTO} 1)", min=1)
    zero_stage: int | Literal["auto"] = opt("auto", f"ZeRO stage for the estimate ({_AUTO} 0)", min=0, max=3)
    loop: str = opt(
        "auto",
        "The training loop probes run and the estimate follows: hf (the HF Trainer: zero_grad after the step, "
        "gradient clipping), lightning (zero_grad between forward and backward) or plain (zero_grad after the step); "
        f"{_AUTO} the loop of the framework the config is written for, else lightning (the most memory)",
        choices=("auto", "hf", "lightning", "plain"),
    )
    margin: float = opt(0.85, "Plan for at most this share of GPU memory", min=0.1, max=0.99)
    gpu_memory_gb: float | Literal["auto"] = opt("auto", 'GPU memory in GB, or "auto" (NVML)', min=0.1)
    measure: bool = opt(False, "Measure with probes on the GPU instead of estimating only")


@dataclass
class PlanProfile(ProfileBase):
    kind: ClassVar[str] = "plan"
    title: ClassVar[str] = "Memory plan"
    run: RunSection = section(RunSection, "Where probes run")
    model: ModelSection = section(ModelSection, "The model being trained")
    plan: PlanSection = section(PlanSection, "Training setup and search")
