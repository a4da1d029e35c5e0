"""The demo models' training loop: AdamW, warmup then linear decay, checkpoints with their learning rates."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from gpuopt_tui.jobs.data import trim_batch


@dataclass(frozen=True)
class TrainPlan:
    epochs: int
    batch_size: int
    lr: float
    checkpoint_epochs: tuple[int, ...]  # 1-based epochs after which a checkpoint is saved
    warmup_fraction: float = 0.1
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.01
    clip_norm: float = 1.0

    def lr_at(self, step: int, total: int) -> float:
        """Learning rate used by optimizer step `step` (0-based) of `total`."""
        warm = max(1, round(total * self.warmup_fraction))
        if step < warm:
            return self.lr * (step + 1) / warm
        progress = (step - warm) / max(1, total - warm - 1)
        return self.lr * (1.0 - (1.0 - self.final_lr_fraction) * min(1.0, progress))


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Build on one CPU thread: these models are too small to gain from more, extra threads only spin when
    the machine is busy, and one thread makes the build the same everywhere."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train(
    model: nn.Module,
    loss_fn: Callable[[Mapping[str, Tensor]], Tensor],
    tensors: Mapping[str, Tensor],
    token_fields: Mapping[str, str],
    plan: TrainPlan,
    checkpoint_dir: Path,
    seed: int,
    on_step: Callable[[int, int], None] | None = None,
) -> tuple[list[dict[str, Any]], float]:
    """Train `model` in place on `tensors` (mean of `loss_fn` over each batch); returns the checkpoint records
    ({"file", "epoch", "step", "lr"}, file relative to checkpoint_dir's parent) and the seconds spent.
    `on_step(done, total)` is called after every optimizer step."""
    n = next(iter(tensors.values())).shape[0]
    steps_per_epoch = -(-n // plan.batch_size)
    total = plan.epochs * steps_per_epoch
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.lr, weight_decay=plan.weight_decay)
    generator = torch.Generator().manual_seed(seed)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    step = 0
    start = time.perf_counter()
    model.train()
    # dropout draws from the global generator: seed it here so the weights depend only on `seed`
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for epoch in range(1, plan.epochs + 1):
            order = torch.randperm(n, generator=generator)
            for first in range(0, n, plan.batch_size):
                idx = order[first : first + plan.batch_size]
                batch = trim_batch({k: v[idx] for k, v in tensors.items()}, token_fields)
                for group in optimizer.param_groups:
                    group["lr"] = plan.lr_at(step, total)
                loss = loss_fn(batch)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), plan.clip_norm)
                optimizer.step()
                step += 1
                if on_step is not None:
                    on_step(step, total)
            if epoch in plan.checkpoint_epochs:
                path = checkpoint_dir / f"epoch-{epoch:02d}.safetensors"
                state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
                save_file(state, str(path))
                records.append(
                    {
                        "file": f"{checkpoint_dir.name}/{path.name}",
                        "epoch": epoch,
                        "step": step,
                        "lr": plan.lr_at(step - 1, total),
                    }
                )
    model.eval()
    return records, time.perf_counter() - start
