"""The reference loop of the planner benchmarks: transformers.Trainer training a model built from its config for a
few optimizer steps on synthetic rows, in a fresh process, and the peak GPU memory it took.

    python benchmarks/trainer_loop.py < request.json      # Trainer output, then one line "result: {...}"

The request is the planner's probe request (core/planner/measure.py `probe_request`: the Hugging Face config, the
task, the training setup with micro_batch and accumulate, the device, `steps` = optimizer steps), and optionally
`card_total`: the bytes of the card the plan was made for, when it is smaller than this one (torch's allocator may
then hold that less the CUDA context: `torch.cuda.set_per_process_memory_fraction`, so that the run meets the
smaller card's limit instead of running on in the larger one's memory).

The model is built as the planner's probes build it (`memprobe.build_model`: random fp32 weights, SDPA attention,
a padding id for classification), then trained as a user's Trainer script trains it: LoRA through peft
(`LoraConfig`: the setup's rank and targets, alpha 16, no dropout), gradient checkpointing, bf16/fp16 autocast and
the optimizer set by `TrainingArguments` (AdamW: the Trainer's default implementation), logging, saving and
evaluation off. Rows are random tokens of the full sequence length with their labels (`memprobe.make_batch`), the
Trainer's default collator stacking them. The peak counts the whole run (torch.cuda.max_memory_reserved and
max_memory_allocated), with the reserved peak after each optimizer step, the allocator's retries
(`num_alloc_retries`: it had to free cached blocks to find room) and the memory outside torch afterwards (CUDA
context and kernels). An out-of-memory error is a result (oom = true). On the CPU there are no memory figures:
the run shows that the loop trains at that batch.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gpuopt_tui.core.planner.measure import ALLOC_CONF
from gpuopt_tui.jobs.memprobe import build_model, make_batch

RESULT = "result: "
LORA_ALPHA = 16
# TrainSetup.optimizer -> TrainingArguments.optim (None: the Trainer's default AdamW)
OPTIM = {"adamw": None, "sgd": "sgd", "adam8bit": "adamw_bnb_8bit"}


class Rows(torch.utils.data.Dataset):
    """The rows of one large synthetic batch, one dict of tensors each."""

    def __init__(self, batch: Mapping[str, torch.Tensor]) -> None:
        self.batch = dict(batch)

    def __len__(self) -> int:
        return len(next(iter(self.batch.values())))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.batch.items()}


def _model(request: Mapping[str, Any], device: torch.device) -> nn.Module:
    """The planner's model on `device`, with peft's LoRA where the setup trains LoRA; checkpointing is the
    Trainer's to set."""
    lora = request["trainable"] == "lora"
    trainable = "all" if lora else request["trainable"]
    model = build_model({**request, "trainable": trainable, "gradient_checkpointing": False}, device)
    if not lora:
        return model
    import peft

    targets = list(request["lora_targets"])
    config = peft.LoraConfig(
        r=int(request["lora_rank"]),
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        task_type="SEQ_CLS" if request["task"] == "classification" else None,  # the head trains, as in the plan
    )
    return peft.get_peft_model(model, config)


def _arguments(request: Mapping[str, Any], output_dir: str, cuda: bool) -> Any:
    from transformers import TrainingArguments

    optim = OPTIM[request["optimizer"]]
    return TrainingArguments(
        output_dir=output_dir,
        max_steps=int(request["steps"]),
        per_device_train_batch_size=int(request["micro_batch"]),
        gradient_accumulation_steps=int(request["accumulate"]),
        learning_rate=1e-5,
        bf16=request["precision"] == "bf16-mixed",
        fp16=request["precision"] == "fp16-mixed",
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        use_cpu=not cuda,
        seed=int(request.get("seed", 0)),
        **({"optim": optim} if optim else {}),
        # passed only when on: newer transformers warn that the flag is renamed, older ones lack the new name
        **({"gradient_checkpointing": True} if request["gradient_checkpointing"] else {}),
    )


def _outside_torch(device: torch.device) -> tuple[int, int]:
    """(memory outside torch's allocator: CUDA context, kernels, other processes; the card's total)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device), total


def train(request: Mapping[str, Any]) -> dict[str, Any]:
    from transformers import Trainer, TrainerCallback, default_data_collator

    if request["task"] == "embedding" or int(request.get("n_positives", 0)) or int(request.get("n_negatives", 0)):
        return {"error": "the reference Trainer loop trains models whose loss comes from labels, not contrastive ones"}
    device = torch.device(request.get("device", "cuda"))
    cuda = device.type == "cuda"
    result: dict[str, Any] = {"micro_batch": int(request["micro_batch"]), "accumulate": int(request["accumulate"])}
    started = time.perf_counter()
    if cuda:
        torch.cuda.set_device(device)
        torch.cuda.init()
        context, total = _outside_torch(device)
        result.update(device=torch.cuda.get_device_name(device), context_at_init=context, gpu_total=total)
        card = int(request.get("card_total") or total)
        if card < total:
            result["reserve_limit"] = card - context
            torch.cuda.set_per_process_memory_fraction((card - context) / total, device)
    torch.manual_seed(int(request.get("seed", 0)))
    step_peaks: list[int] = []

    class StepPeaks(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step_peaks.append(torch.cuda.max_memory_reserved(device) if cuda else 0)

    rows = int(request["micro_batch"]) * int(request["accumulate"]) * int(request["steps"])
    try:
        model = _model(request, device)
        batch = make_batch(model, {**request, "micro_batch": rows}, torch.device("cpu"))
        with tempfile.TemporaryDirectory() as out:
            args = _arguments(request, out, cuda)
            result["optim"] = str(getattr(args.optim, "value", args.optim))
            trainer = Trainer(
                model=model,
                args=args,
                train_dataset=Rows(batch),
                data_collator=default_data_collator,
                callbacks=[StepPeaks()],
            )
            trained = time.perf_counter()
            trainer.train()
            result["train_seconds"] = time.perf_counter() - trained
        result["optimizer_steps"] = len(step_peaks)
        result["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        result["oom"] = False
    except torch.OutOfMemoryError:
        result["oom"] = True
    except Exception as error:  # the run's failure is its result, with the reason
        result["error"] = f"{type(error).__name__}: {error}"
    if cuda:
        stats = torch.cuda.memory_stats(device)
        result.update(
            max_reserved=torch.cuda.max_memory_reserved(device),
            max_allocated=torch.cuda.max_memory_allocated(device),
            num_alloc_retries=int(stats.get("num_alloc_retries", 0)),
            num_ooms=int(stats.get("num_ooms", 0)),
            step_peaks=step_peaks,
        )
        result["context"] = max(_outside_torch(device)[0], result["context_at_init"])  # kernels load lazily
    result["seconds"] = time.perf_counter() - started
    return result


def main() -> int:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)  # the planner's probes' allocator, before CUDA starts
    result = train(json.loads(sys.stdin.read()))
    print(RESULT + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
