"""One memory probe: a real training step of a model built from its config, measured, in a fresh process.

    python -m gpuopt_tui.jobs.memprobe < request.json      # prints one JSON line (ProbeResult fields)

The request (see core/planner/measure.py `probe_request`) holds the Hugging Face config, the task and the
training setup. The model gets random weights (fp32 parameters; bf16/fp16 autocast for mixed precision), the
batch is random tokens at the full sequence length, HF models compute their own loss from `labels=`, and the
step follows the setup's loop (`training_step`). Warm-up steps (the first creates the optimizer state), then the
measured steps, all as the user's loop runs them, without emptying the allocator's cache: the peak reserved memory
of each step is kept, and `drift` is how far the measured steps' peak rose above the warm-up's.
An out-of-memory error is a result (oom = true), not a crash. On the CPU, where torch keeps no memory statistics,
`max_allocated` is the peak of live tensor bytes over the measured steps (`LiveTensors`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gpuopt_tui.core.planner.measure import ALLOC_CONF
from gpuopt_tui.core.planner.model_spec import ENCODERS
from gpuopt_tui.core.planner.train_setup import fused_adamw

LORA_ALPHA = 16.0
_IN_LAYER = re.compile(r"\.\d+\.")  # module paths inside a stack of layers: "encoder.layer.3.attention..."


class LoRA(nn.Module):
    """base(x) + (x A^T B^T) * alpha / r, with A random and B zero (so the output starts unchanged)."""

    def __init__(self, base: nn.Module, d_in: int, d_out: int, rank: int) -> None:
        super().__init__()
        weight = next(base.parameters())
        self.base = base
        self.lora_a = nn.Parameter(torch.randn(rank, d_in, device=weight.device) / math.sqrt(d_in))
        self.lora_b = nn.Parameter(torch.zeros(d_out, rank, device=weight.device))
        self.scale = LORA_ALPHA / rank

    @property
    def weight(self) -> torch.Tensor:
        """The adapted layer's weight, which some models read (T5 checks its dtype)."""
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale


def _linear_dims(module: nn.Module) -> tuple[int, int] | None:
    """(d_in, d_out) of nn.Linear or transformers' Conv1D (GPT-2: weight is d_in x d_out)."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D":
        return int(module.weight.shape[0]), int(module.weight.shape[1])
    return None


def _layer_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, tuple[int, int]]]:
    """(parent, short name, layer, (d_in, d_out)) of each linear layer inside the model's stack of layers."""
    found = []
    for path, module in model.named_modules():
        for name, child in module.named_children():
            dims = _linear_dims(child)
            if dims and _IN_LAYER.search(f"{path}.{name}."):
                found.append((module, name, child, dims))
    return found


def layer_linear_names(model: nn.Module) -> list[str]:
    """The short names of the linear layers inside the model's stack of layers (what LoRA targets name)."""
    return sorted({name for _, name, _, _ in _layer_linears(model)})


def add_lora(model: nn.Module, targets: list[str], rank: int) -> int:
    """Wrap the targeted linear layers inside the layer stack with LoRA adapters; returns how many."""
    swaps = [found for found in _layer_linears(model) if "all-linear" in targets or found[1] in targets]
    for module, name, child, (d_in, d_out) in swaps:
        setattr(module, name, LoRA(child, d_in, d_out, rank))
    return len(swaps)


class LiveTensors(TorchDispatchMode):
    """The bytes of tensor storage alive while it is active, and their peak: every op's outputs are counted once
    per storage (views and in-place results share one) until the storage is freed. Tensors made before it starts
    count when passed to `add`. Allocations inside a kernel that never become tensors are not seen."""

    def __init__(self, existing: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        for t in existing:
            self.add(t)

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._sizes:
            return
        self._sizes[key] = storage.nbytes()
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.add(leaf)
        return out


def _step_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: Mapping[str, torch.Tensor]
) -> list[torch.Tensor]:
    """What a training step finds allocated: weights, buffers, gradients, optimizer state and the batch."""
    state = [v for per_param in optimizer.state.values() for v in per_param.values() if isinstance(v, torch.Tensor)]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [*model.parameters(), *model.buffers(), *grads, *state, *batch.values()]


def _head_parameters(model: nn.Module, task: str) -> list[nn.Parameter]:
    """The task head (and a BERT/RoBERTa pooler) of a model whose encoder is frozen."""
    prefix = getattr(model, "base_model_prefix", "") + "."
    if task == "embedding":
        return [p for n, p in model.named_parameters() if "pooler." in n]
    return [p for n, p in model.named_parameters() if not n.startswith(prefix) or ".pooler." in n]


def build_model(request: Mapping[str, Any], device: torch.device) -> nn.Module:
    from transformers import (
        AutoConfig,
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForMaskedLM,
        AutoModelForSeq2SeqLM,
        AutoModelForSequenceClassification,
    )

    fields = {k: v for k, v in request["config"].items() if k not in ("dtype", "torch_dtype")}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config.use_cache = False
    if request["task"] == "classification" and config.pad_token_id is None:
        # decoders pool the last token that is not padding, and refuse batches without a padding id
        eos = config.eos_token_id
        config.pad_token_id = eos if isinstance(eos, int) and 0 <= eos < config.vocab_size else 0
    if request["task"] == "classification" and config.problem_type is None and config.num_labels > 1:
        # what models infer from integer labels; said outright, DeBERTa's loss does not look for unlabelled rows
        # (a data-dependent nonzero() that fake tensors cannot run, over a batch-sized tensor)
        config.problem_type = "single_label_classification"
    auto = {
        "classification": AutoModelForSequenceClassification,
        "causal_lm": AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM,
        "masked_lm": AutoModelForMaskedLM,
        "embedding": AutoModel,
    }[request["task"]]
    with device:
        try:
            model = auto.from_config(config, attn_implementation="sdpa")
        except ValueError as error:  # a model class without SDPA attention runs its own (eager) attention
            if "scaled_dot_product_attention" not in str(error):
                raise
            model = auto.from_config(config, attn_implementation="eager")
    if any(p.dtype != torch.float32 for p in model.parameters()):
        model.float()  # only when needed: converting fake tensors (the traced tier) cannot swap them in place
    model.train()
    trainable = request["trainable"]
    if trainable != "all":
        model.requires_grad_(False)
        if trainable == "lora" and not add_lora(model, list(request["lora_targets"]), int(request["lora_rank"])):
            raise ValueError(
                f"LoRA targets {', '.join(request['lora_targets'])} match no linear layer inside the layers; "
                f"they have: {', '.join(layer_linear_names(model)) or 'none'} (or use all-linear)"
            )
        if trainable == "frozen_encoder" or request["task"] == "classification":
            for p in _head_parameters(model, request["task"]):
                p.requires_grad_(True)
    if request["gradient_checkpointing"]:
        model.gradient_checkpointing_enable()
    return model


def make_batch(model: nn.Module, request: Mapping[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    config = model.config
    spe = 1 + int(request["n_positives"]) + int(request["n_negatives"])
    rows, length = int(request["micro_batch"]) * spe, int(request["seq_len"])
    ids = torch.randint(0, config.vocab_size, (rows, length), device=device)
    mask = torch.ones_like(ids)
    if config.model_type in ENCODERS:
        mask[::2, -1] = 0  # padded rows, as in real encoder batches: the attention mask path
    batch = {"input_ids": ids, "attention_mask": mask}
    task = request["task"]
    if task == "classification":
        batch["labels"] = torch.randint(0, config.num_labels, (rows,), device=device)
    elif task == "causal_lm":
        batch["labels"] = ids
    elif task == "masked_lm":
        batch["labels"] = torch.where(torch.rand(ids.shape, device=device) < 0.15, ids, -100)
    return batch


def loss_function(model: nn.Module, request: Mapping[str, Any]) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    if request["task"] != "embedding":
        if request.get("loop") == "hf" and request.get("precision") in ("bf16-mixed", "fp16-mixed"):
            return lambda batch: _as_the_trainer_returns(model(**batch)).loss
        return lambda batch: model(**batch).loss
    spe = 1 + int(request["n_positives"]) + int(request["n_negatives"])

    def contrastive(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = model(**batch).last_hidden_state
        weights = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        emb = F.normalize((hidden * weights).sum(1) / weights.sum(1), dim=-1)
        anchors = emb[::spe]
        scores = anchors @ emb.T / 0.05
        positive = torch.arange(anchors.shape[0], device=emb.device) * spe + (1 if spe > 1 else 0)
        return F.cross_entropy(scores.float(), positive)

    return contrastive


def _as_the_trainer_returns(out: Any) -> Any:
    """The outputs as the HF Trainer's model returns them under mixed precision: accelerate wraps its forward in
    `convert_outputs_to_fp32`, which copies each 16-bit tensor of the output (an LM's logits) to fp32 at the end of
    the forward, while the 16-bit ones still exist: a peak of its own for a model whose activations are small."""
    if not isinstance(out, Mapping):
        return out
    return type(out)(
        **{
            k: v.float() if isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16) else v
            for k, v in out.items()
        }
    )


def make_optimizer(
    params: list[nn.Parameter], request: Mapping[str, Any], foreach: bool | None = None
) -> torch.optim.Optimizer:
    """The optimizer the request names, as its loop builds it: torch's fused AdamW where the loop's is
    (`fused_adamw`), else `foreach` (None: torch's default for the parameters' device)."""
    name = request["optimizer"]
    if name == "adamw":
        fused = fused_adamw(name, request.get("loop", "lightning"))
        return torch.optim.AdamW(params, lr=1e-5, **({"fused": True} if fused else {"foreach": foreach}))
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=foreach)
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ValueError("optimizer adam8bit needs bitsandbytes, which is not installed here") from None
    return bnb.optim.AdamW8bit(params, lr=1e-5)


def training_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    loss_of: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    batch: dict[str, torch.Tensor],
    request: Mapping[str, Any],
    amp_dtype: torch.dtype | None,
    device: torch.device,
    phase: Callable[[str], None] = lambda name: None,
) -> Callable[[], None]:
    """One optimizer step as the request's loop runs it: "hf" (the Trainer: backward, clip gradient norms to 1,
    step, zero_grad with set_to_none), "plain" (backward, step, zero_grad) or "lightning" (zero_grad between
    the forward pass and backward, so the previous gradients live through the forward pass). `phase` is told
    "forward", "backward" and "optimizer step" as each begins."""
    loop = request.get("loop", "lightning")
    micro_steps = 2 if int(request.get("accumulate", 1)) > 1 else 1
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        for i in range(micro_steps):
            phase("forward")
            with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                loss = loss_of(batch)
            if loop == "lightning" and i == 0:
                optimizer.zero_grad(set_to_none=True)  # after training_step, before backward
            phase("backward")
            (scaler.scale(loss) if scaler else loss).backward()
            del loss
        phase("optimizer step")
        if loop == "hf":
            if scaler:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if loop != "lightning":
            optimizer.zero_grad(set_to_none=True)

    return step


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def _free_context(device: torch.device) -> tuple[int, int]:
    """(memory outside torch's allocator: CUDA context, loaded kernels, other processes; total memory)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device), total


def probe(request: Mapping[str, Any]) -> dict[str, Any]:
    device = torch.device(request.get("device", "cuda"))
    cuda = device.type == "cuda"
    spe = 1 + int(request["n_positives"]) + int(request["n_negatives"])
    result: dict[str, Any] = {
        "micro_batch": int(request["micro_batch"]),
        "sequences": int(request["micro_batch"]) * spe,
        "device": str(device),
    }
    started = time.perf_counter()
    if cuda:
        torch.cuda.set_device(device)
        result["context_at_init"], result["gpu_total"] = _free_context(device)
        result["device"] = torch.cuda.get_device_name(device)
    torch.manual_seed(int(request.get("seed", 0)))
    precision = request["precision"]
    amp_dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(precision)
    try:
        model = build_model(request, device)
        params = [p for p in model.parameters() if p.requires_grad]
        result["params"] = sum(p.numel() for p in model.parameters())
        result["trainable_params"] = sum(p.numel() for p in params)
        optimizer = make_optimizer(params, request)
        scaler = torch.amp.GradScaler("cuda") if cuda and amp_dtype is torch.float16 else None
        batch = make_batch(model, request, device)
        loss_of = loss_function(model, request)
        step = training_step(model, optimizer, scaler, loss_of, batch, request, amp_dtype, device)
        warmup, steps = int(request.get("warmup", 1)), int(request.get("steps", 2))
        if not cuda:
            for _ in range(warmup):
                step()
            with LiveTensors(_step_tensors(model, optimizer, batch)) as live:
                for _ in range(steps):
                    step()
            result["max_allocated"] = live.peak
        else:
            retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
            peaks = []
            for _ in range(warmup + steps):  # as the user's loop runs: no cache emptied between steps
                torch.cuda.reset_peak_memory_stats(device)
                step()
                torch.cuda.synchronize(device)
                peaks.append(torch.cuda.max_memory_reserved(device))
                result["max_allocated"] = max(result.get("max_allocated", 0), torch.cuda.max_memory_allocated(device))
            result["max_reserved"] = max(peaks)
            result["step_peaks"] = peaks
            result["drift"] = max(0, max(peaks[warmup:], default=0) - max(peaks[:warmup], default=peaks[0]))
            result["num_alloc_retries"] = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries
            after, _ = _free_context(device)
            # kernels load lazily, so the context grows after init: keep the larger figure
            result["context"] = max(after, result["context_at_init"])
    except Exception as error:  # an out-of-memory error is a result; anything else is reported as an error
        if not _is_oom(error):
            result["error"] = f"{type(error).__name__}: {error}"
        result["oom"] = _is_oom(error)
    result["seconds"] = time.perf_counter() - started
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuopt_tui.jobs.memprobe", description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)  # before the first CUDA allocation
    result = probe(json.loads(sys.stdin.read()))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
