"""The checkpoints a TracIn run sums over: the profile's files with their learning rates, or the model's own.

A checkpoint is a full state dict (a file) or a PEFT adapter directory (adapter_model.safetensors beside
adapter_config.json, recognised from those files) on the profile's model as the base; one run takes one kind.
Adapter checkpoints wrap the adapter's model in the PEFT adapter here (peft_adapters.py). Files are only checked
otherwise; `Adapter.load_weights` reads them (safetensors, or torch files with weights_only=True) when the run
reaches each one, and names the file when it cannot.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.tracin import CheckpointSpec
from gpuopt_tui.jobs.models.base import Adapter, Checkpoint
from gpuopt_tui.jobs.models.peft_adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_weights_file,
    check_same_config,
    wrap_with_adapter,
)

STATE_DICT = "state dict"
PEFT_ADAPTER = "PEFT adapter"


def resolve_checkpoints(specs: Sequence[CheckpointSpec], adapter: Adapter) -> list[Checkpoint]:
    """The checkpoints to sum over; adapter checkpoints as their weights files, with `adapter.model` wrapped in the
    adapter (once: a second call on the same adapter leaves it as it is)."""
    if not specs:
        if not adapter.checkpoints:
            raise UserError(
                f"tracin.checkpoints is empty and model {adapter.name} has no training checkpoints of its own: "
                'list the checkpoint files with their learning rates, e.g. checkpoints = [{ path = "...", lr = 1e-5 }]'
            )
        checkpoints = list(adapter.checkpoints)
    else:
        checkpoints = [Checkpoint(Path(spec.path).expanduser(), spec.lr) for spec in specs]
    kinds = [_kind(i, ckpt.path) for i, ckpt in enumerate(checkpoints)]
    for i, kind in enumerate(kinds):
        if kind != kinds[0]:
            raise UserError(
                f"tracin.checkpoints[{i}]: {checkpoints[i].path} is a {kind} checkpoint, but "
                f"{checkpoints[0].path} is a {kinds[0]} one: all checkpoints of a run must be of one kind"
            )
    if all(ckpt.lr == 0 for ckpt in checkpoints):
        raise UserError("tracin.checkpoints: every learning rate is 0, so every score would be 0")
    if kinds[0] == PEFT_ADAPTER:
        weights = [adapter_weights_file(c.path) for c in checkpoints]  # none is None: every kind is PEFT_ADAPTER
        checkpoints = [Checkpoint(w, c.lr) for w, c in zip(weights, checkpoints) if w is not None]
        check_same_config([c.path for c in checkpoints])
        if adapter.peft_trainable is None:
            wrap_with_adapter(adapter, checkpoints[0].path)
    return checkpoints


def _kind(i: int, path: Path) -> str:
    if adapter_weights_file(path) is not None:
        return PEFT_ADAPTER
    if path.is_file():
        return STATE_DICT
    if path.is_dir():
        raise UserError(
            f"tracin.checkpoints[{i}]: {path} is a directory but not a PEFT adapter directory "
            f"(expected {ADAPTER_WEIGHTS} and {ADAPTER_CONFIG} in it), nor a state-dict file"
        )
    raise UserError(f"tracin.checkpoints[{i}]: {path}: checkpoint file not found")
