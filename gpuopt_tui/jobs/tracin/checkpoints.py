"""The checkpoints a TracIn run sums over: the profile's files with their learning rates, or the model's own.

Files are only checked here; `Adapter.load_weights` reads them (safetensors, or torch files with
weights_only=True) when the run reaches each one, and names the file when it cannot.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.tracin import CheckpointSpec
from gpuopt_tui.jobs.models.base import Adapter, Checkpoint


def resolve_checkpoints(specs: Sequence[CheckpointSpec], adapter: Adapter) -> list[Checkpoint]:
    if not specs:
        if not adapter.checkpoints:
            raise UserError(
                f"tracin.checkpoints is empty and model {adapter.name} has no training checkpoints of its own: "
                'list the checkpoint files with their learning rates, e.g. checkpoints = [{ path = "...", lr = 1e-5 }]'
            )
        checkpoints = list(adapter.checkpoints)
    else:
        checkpoints = [Checkpoint(Path(spec.path).expanduser(), spec.lr) for spec in specs]
    for i, ckpt in enumerate(checkpoints):
        if not ckpt.path.is_file():
            raise UserError(f"tracin.checkpoints[{i}]: {ckpt.path}: checkpoint file not found")
    if all(ckpt.lr == 0 for ckpt in checkpoints):
        raise UserError("tracin.checkpoints: every learning rate is 0, so every score would be 0")
    return checkpoints
