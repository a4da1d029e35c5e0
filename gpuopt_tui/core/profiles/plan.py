"""Schema of a memory plan profile."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from gpuopt_tui.core.profiles.common import ModelSection, ProfileBase, RunSection
from gpuopt_tui.core.profiles.schema import Failure, opt, section

ROLES_HELP = "batch_size, accumulate, n_positives, n_negatives, precision, seq_len, devices, gradient_checkpointing"


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
        "Training precision (auto: the config's trainer precision, else bf16-mixed)",
        choices=("auto", "fp32", "bf16-mixed", "fp16-mixed"),
    )
    optimizer: str = opt("adamw", "Optimizer (sets state size)", choices=("adamw", "sgd", "adam8bit"))
    trainable: str = opt("all", "What trains", choices=("all", "frozen_encoder", "lora"))
    lora_rank: int = opt(8, "LoRA rank (trainable = lora)", min=1)
    lora_targets: list[str] = opt(["query", "value"], "Linear layers adapted by LoRA, by name (or all-linear)")
    gradient_checkpointing: bool | Literal["auto"] = opt(
        "auto", "Recompute activations in the backward pass (auto: the config's setting, else off)"
    )
    seq_len: int | Literal["auto"] = opt("auto", "Sequence length, worst case (auto: the config's, else 128)", min=1)
    micro_batch: int | Literal["auto"] = opt("auto", "Micro-batch to show (auto: the config's, else 8)", min=1)
    effective_batch: int = opt(0, "Effective batch to keep via accumulation (0 = keep the config's)", min=0)
    accumulation: str = opt(
        "exact",
        "exact: a micro-batch dividing the effective batch; approx: the largest micro-batch, deviation shown",
        choices=("exact", "approx"),
    )
    n_positives: int | Literal["auto"] = opt("auto", "Positive samples per anchor (auto: the config's, else 0)", min=0)
    n_negatives: int | Literal["auto"] = opt("auto", "Negative samples per anchor (auto: the config's, else 0)", min=0)
    n_gpus: int | Literal["auto"] = opt("auto", "GPUs (data parallel; auto: the config's devices, else 1)", min=1)
    zero_stage: int = opt(0, "ZeRO stage for the estimate", min=0, max=3)
    loop: str = opt(
        "lightning",
        "The training loop probes run and the estimate follows: hf (the HF Trainer: zero_grad after the step, "
        "gradient clipping), lightning (zero_grad between forward and backward) or plain (zero_grad after the step)",
        choices=("hf", "lightning", "plain"),
    )
    margin: float = opt(0.85, "Plan for at most this share of GPU memory", min=0.1, max=0.99)
    gpu_memory_gb: float | Literal["auto"] = opt("auto", 'GPU memory in GB, or "auto" (NVML)', min=0.1)
    measure: bool = opt(False, "Measure with probes on the GPU instead of estimating only")

    def check(self, fail: Failure) -> None:
        if self.trainable == "lora" and not self.lora_targets:
            fail("lora_targets", "trainable = lora needs at least one target layer name")


@dataclass
class PlanProfile(ProfileBase):
    kind: ClassVar[str] = "plan"
    title: ClassVar[str] = "Memory plan"
    run: RunSection = section(RunSection, "Where probes run")
    model: ModelSection = section(ModelSection, "The model being trained")
    plan: PlanSection = section(PlanSection, "Training setup and search")
