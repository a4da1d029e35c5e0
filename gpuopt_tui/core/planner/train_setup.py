"""The training step the planner sizes (`TrainSetup`) and the choices each of its fields allows, with the
per-parameter byte counts of each optimizer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gpuopt_tui.core.errors import UserError

MiB = 1024**2
GiB = 1024**3
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
OPTIMIZERS = ("adamw", "sgd", "adam8bit")
TRAINABLE = ("all", "frozen_encoder", "lora")
# When a training loop frees gradients: "hf" (Trainer: zero_grad after the optimizer step, and it clips gradient
# norms), "plain" (zero_grad before the forward or after the step), "lightning" (between forward and backward)
LOOPS = ("hf", "lightning", "plain")
# bytes of optimizer state per trainable parameter
OPTIMIZER_STATE = {"adamw": 8.0, "sgd": 4.0, "adam8bit": 2.0 + 2 * 4 / 2048}
# bytes of temporaries per trainable parameter while the optimizer steps: the foreach AdamW (torch's default on a
# GPU) builds one fp32 list (sqrt of the second moment); SGD momentum, bitsandbytes and fused AdamW update in place
OPTIMIZER_TEMP = {"adamw": 4.0, "sgd": 0.0, "adam8bit": 0.0}
# Loops whose AdamW is torch's fused one: the HF Trainer's default optimizer (`TrainingArguments.optim`) is
# "adamw_torch_fused" with torch 2.8 and later. Traced with the foreach one, a Mixtral-shaped model trained in full
# at micro-batch 1 peaked in its update (its 2.9 GiB list of square roots), 8.7% above the Trainer's real peak, which
# was its backward's (benchmarks/results/planner_recommend_all_H200.md)
FUSED_ADAMW_LOOPS = ("hf",)

MAX_BATCH = 1 << 20  # the largest micro-batch a search tries
# The most of each count that any GPU could hold, whatever the model (a larger value is a slip of the keyboard):
# sequences in a micro-batch or per anchor, tokens in a sequence, LoRA's rank
MAXIMA = {
    "micro_batch": MAX_BATCH,
    "n_positives": MAX_BATCH,
    "n_negatives": MAX_BATCH,
    "seq_len": 1 << 24,
    "lora_rank": 1 << 16,
}


def out_of_range(name: str, value: int) -> str:
    """What a TrainSetup count `name` must be when `value` is above its maximum, else ""."""
    most = MAXIMA.get(name)
    return f"expected at most {most:,}: no GPU holds more" if most is not None and value > most else ""


def fused_adamw(optimizer: str, loop: str) -> bool:
    """Whether `optimizer` in `loop` is torch's fused AdamW (`FUSED_ADAMW_LOOPS`), which steps without temporaries."""
    return optimizer == "adamw" and loop in FUSED_ADAMW_LOOPS


@dataclass(frozen=True)
class TrainSetup:
    """A training step as the planner sees it."""

    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    trainable: str = "all"
    lora_rank: int = 8
    lora_targets: tuple[str, ...] = ("query", "value")
    gradient_checkpointing: bool = False
    seq_len: int = 128
    micro_batch: int = 8
    n_positives: int = 0  # samples per anchor: each example is 1 + n_positives + n_negatives sequences
    n_negatives: int = 0
    accumulate: int = 1
    n_gpus: int = 1
    zero_stage: int = 0
    loop: str = "lightning"  # one of LOOPS: lightning keeps the previous gradients through the forward pass

    @property
    def sequences_per_example(self) -> int:
        return 1 + self.n_positives + self.n_negatives

    @property
    def sequences(self) -> int:
        return self.micro_batch * self.sequences_per_example

    @property
    def tokens(self) -> int:
        return self.sequences * self.seq_len

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.accumulate * self.n_gpus

    @property
    def mixed(self) -> bool:
        return self.precision != "fp32"

    @property
    def fused_adamw(self) -> bool:
        """Whether the loop's AdamW is torch's fused one (`fused_adamw`)."""
        return fused_adamw(self.optimizer, self.loop)

    @property
    def optimizer_temp(self) -> float:
        """Bytes of temporaries per trainable parameter while the optimizer steps (`OPTIMIZER_TEMP`)."""
        return 0.0 if self.fused_adamw else OPTIMIZER_TEMP[self.optimizer]

    def with_batch(self, micro_batch: int, accumulate: int | None = None) -> TrainSetup:
        return dataclasses.replace(
            self, micro_batch=micro_batch, accumulate=self.accumulate if accumulate is None else accumulate
        )

    def check(self) -> None:
        """Raise UserError for values no estimate can be made for."""
        choices = {"precision": PRECISIONS, "optimizer": OPTIMIZERS, "trainable": TRAINABLE, "loop": LOOPS}
        for key, allowed in choices.items():
            value = getattr(self, key)
            if value not in allowed:
                raise UserError(f'{key} "{value}": expected one of {", ".join(allowed)}')
        for key in ("seq_len", "micro_batch", "accumulate", "n_gpus", "lora_rank"):
            if getattr(self, key) < 1:
                raise UserError(f"{key} = {getattr(self, key)}: expected a positive integer")
        for key in ("n_positives", "n_negatives"):
            if getattr(self, key) < 0:
                raise UserError(f"{key} = {getattr(self, key)}: expected 0 or more")
        for key in MAXIMA:
            expected = out_of_range(key, getattr(self, key))
            if expected:
                raise UserError(f"{key} = {getattr(self, key)}: {expected}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise UserError(f"zero_stage = {self.zero_stage}: expected 0, 1, 2 or 3")
