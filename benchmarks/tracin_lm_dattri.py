"""dattri's LoGra on the LoRA adapter of tracin_lm_bench.py's decoder: its row of that benchmark.

dattri's LoGraAttributor (identity Hessian: the projected-gradient dot product, i.e. TracIn at one checkpoint) with
its hooks on every LoRA sub-layer (`lora_A` and `lora_B` of each adapted Linear layer: the adapter's parameters, as
our run's), proj_dim = projection^2 (projection x projection per matrix, as ours), one attributor per checkpoint and
the scores summed with the checkpoints' learning rates, as a user writes it from dattri's documentation: a data
loader of rows padded to the batch's longest, the loss the completion's mean token cross-entropy (prompt and padding
masked) averaged over the batch (LoGra multiplies each example's gradient by the batch size), the whole logits
computed, bf16 autocast on a GPU as our run (fp32 with --dattri-fp32). Timed from the first checkpoint's load to the
last scores (gradients of the training rows and of the queries, the products), the GPU synchronised.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def lora_sub_layers(model: nn.Module) -> list[str]:
    """The names of the `lora_A` / `lora_B` Linear sub-layers of a PEFT model (their one adapter each)."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 2)[-2:-1] in (["lora_A"], ["lora_B"])
    ]


def labelled(rows: list[tuple[Tensor, int]]) -> list[dict[str, Tensor]]:
    """Each row's [prompt | completion] ids (with its prompt's length) and its labels (-100 on the prompt)."""
    out = []
    for ids, n_prompt in rows:
        labels = ids.clone()
        labels[:n_prompt] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def collate(pad_id: int) -> Any:
    """Right padding to the batch's longest row, with its attention mask; padding labelled -100."""

    def pad(rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), pad_id)
        labels = torch.full((len(rows), width), -100)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n], labels[i, :n], mask[i, :n] = r["input_ids"], r["labels"], 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    return pad


def completion_loss(model: nn.Module, data: dict[str, Tensor], device: str, autocast: bool) -> Tensor:
    """Mean over the batch of each row's mean token cross-entropy over its completion."""
    with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
        logits = model(input_ids=data["input_ids"].to(device), attention_mask=data["attention_mask"].to(device)).logits
    labels = data["labels"].to(device)[:, 1:]
    tokens = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels, reduction="none", ignore_index=-100)
    counted = (labels != -100).sum(1).clamp_min(1)
    return (tokens.sum(1) / counted).mean()


def dattri_logra_scores(
    model: nn.Module, pad_id: int, checkpoints: list[dict[str, Any]], train: list[tuple[Tensor, int]],
    queries: list[tuple[Tensor, int]], projection: int, batch: int, fp32: bool,
) -> dict[str, Any]:  # fmt: skip
    """([queries, train] scores, seconds, peak GPU memory, settings) of dattri's LoGra (see the module docstring) on
    rows given as (token ids of [prompt | completion], prompt length)."""
    import peft
    from dattri.algorithm.logra import LoGraAttributor
    from dattri.task import AttributionTask
    from safetensors.torch import load_file
    from torch.utils.data import DataLoader

    device = next(model.parameters()).device
    autocast = device.type == "cuda" and not fp32
    layers = lora_sub_layers(model)
    pad = collate(pad_id)
    train_rows, query_rows = labelled(train), labelled(queries)

    def load(model: nn.Module, path: str) -> nn.Module:
        state = load_file(str(Path(path) / "adapter_model.safetensors"))
        peft.set_peft_model_state_dict(model, {k: v.float() for k, v in state.items()})
        return model

    def loss(model: nn.Module, data: dict[str, Tensor], device: str) -> Tensor:
        return completion_loss(model, data, device, autocast)

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start, total = time.perf_counter(), None
    for ckpt in checkpoints:
        task = AttributionTask(loss_func=loss, model=model, checkpoints=ckpt["path"], checkpoints_load_func=load)
        attributor = LoGraAttributor(
            task, layer_names=layers, hessian="Identity", device=str(device), proj_dim=projection**2, offload="none"
        )
        train_loader = DataLoader(train_rows, batch_size=batch, shuffle=False, collate_fn=pad)
        attributor.cache(train_loader)
        scores = attributor.attribute(
            train_loader, DataLoader(query_rows, batch_size=batch, shuffle=False, collate_fn=pad)
        )
        total = ckpt["lr"] * scores.double() if total is None else total + ckpt["lr"] * scores.double()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert total is not None
    return {
        "scores": total.T.cpu(),  # dattri: [train, test]
        "seconds": seconds,
        "peak": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
        "settings": f"proj_dim {projection**2} ({projection} x {projection} per matrix), {len(layers)} LoRA "
        f"sub-layers, batch {batch}, {'fp32' if not autocast else 'bf16 autocast'}",
    }
