"""Schema of a memory plan profile."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from gpuopt_tui.core.profiles.common import ModelSection, ProfileBase, RunSection
from gpuopt_tui.core.profiles.schema import opt, section


@dataclass
class PlanSection:
    config: str = opt("", "Training YAML config to read and update (empty = plan only)")
    precision: str = opt("bf16-mixed", "Training precision", choices=("fp32", "bf16-mixed", "fp16-mixed"))
    optimizer: str = opt("adamw", "Optimizer (sets state size)", choices=("adamw", "sgd", "adam8bit"))
    trainable: str = opt("all", "What trains", choices=("all", "frozen_encoder", "lora"))
    lora_rank: int = opt(8, "LoRA rank (trainable = lora)", min=1)
    lora_targets: list[str] = opt(["query", "value"], "Module names adapted by LoRA")
    gradient_checkpointing: bool = opt(False, "Recompute activations in the backward pass")
    seq_len: int = opt(128, "Sequence length (worst case)", min=1)
    micro_batch: int | Literal["auto"] = opt("auto", 'Micro-batch to check, or "auto" to search', min=1)
    effective_batch: int = opt(0, "Effective batch to keep via accumulation (0 = keep the config's)", min=0)
    n_gpus: int = opt(1, "GPUs (data parallel)", min=1)
    zero_stage: int = opt(0, "ZeRO stage for the estimate", min=0, max=3)
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
