"""PEFT adapter checkpoints: a directory with `adapter_model.safetensors` and `adapter_config.json` (what
`PeftModel.save_pretrained` writes) on the profile's base model.

The base model is wrapped once with `PeftModel.from_pretrained` (the first checkpoint's configuration and weights,
trainable); every checkpoint then loads with `set_peft_model_state_dict`. peft is imported only here, and only when
a checkpoint is an adapter directory.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import Tensor

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.models.base import Adapter

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
INSTALL_HINT = "install peft: pip install 'gpuopt-tui[lm]'"
# keys of adapter_config.json that do not change what the adapter computes
_BOOKKEEPING = {
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "task_type",
    "peft_version",
    "init_lora_weights",
}


def adapter_weights_file(path: Path) -> Path | None:
    """The weights file of a PEFT adapter checkpoint at `path` (the directory, or its weights file itself, beside
    adapter_config.json); None when `path` is not one."""
    folder = path if path.is_dir() else path.parent
    if path.is_file() and path.name != ADAPTER_WEIGHTS:
        return None
    weights = folder / ADAPTER_WEIGHTS
    return weights if weights.is_file() and (folder / ADAPTER_CONFIG).is_file() else None


def import_peft(checkpoint: Path) -> ModuleType:
    try:
        import peft
    except ImportError as exc:
        raise UserError(f"checkpoint {checkpoint} is a PEFT adapter directory; {INSTALL_HINT}") from exc
    return peft


def adapter_config(weights: Path) -> dict[str, Any]:
    """adapter_config.json beside `weights`, without the keys that do not change the computation."""
    path = weights.parent / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: cannot read the adapter configuration ({exc})") from exc
    if not isinstance(config, dict):
        raise UserError(f"{path}: expected a JSON object (the adapter configuration)")
    return {k: v for k, v in config.items() if k not in _BOOKKEEPING}


def check_same_config(weights: list[Path]) -> None:
    """Every checkpoint's adapter must be the same shape: one wrapped model loads them all."""
    first = adapter_config(weights[0])
    for path in weights[1:]:
        other = adapter_config(path)
        if other != first:
            keys = sorted(k for k in first.keys() | other.keys() if first.get(k) != other.get(k))
            raise UserError(
                f"{path.parent / ADAPTER_CONFIG}: differs from {weights[0].parent / ADAPTER_CONFIG} in "
                f"{', '.join(keys)}: all adapter checkpoints of a run must share one configuration"
            )


def wrap_with_adapter(adapter: Adapter, weights: Path) -> None:
    """Wrap `adapter.model` in the PEFT adapter of `weights`' directory (its weights loaded, its parameters
    trainable), and record those parameters' names in `adapter.peft_trainable`."""
    peft = import_peft(weights.parent)
    try:
        config = peft.PeftConfig.from_pretrained(str(weights.parent))
    except Exception as exc:
        raise UserError(f"{weights.parent / ADAPTER_CONFIG}: not a PEFT adapter configuration: {exc}") from exc
    if config.is_prompt_learning:
        raise UserError(
            f"{weights.parent}: a {config.peft_type.value} adapter adds virtual tokens to the sequence, which TracIn's "
            "completion loss does not read; adapters on the weights (LoRA and the like) work"
        )
    try:
        model = peft.PeftModel.from_pretrained(adapter.model, str(weights.parent), is_trainable=True)
    except Exception as exc:
        raise UserError(f"{weights.parent}: cannot apply the PEFT adapter to model {adapter.name}: {exc}") from exc
    adapter.model = model.to(adapter.device).eval()
    adapter.peft_trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if not adapter.peft_trainable:
        raise UserError(f"{weights.parent}: the PEFT adapter has no trainable parameters")


def load_adapter_state(adapter: Adapter, state: Mapping[str, Tensor], source: Path) -> None:
    """Load an adapter checkpoint's state dict into the wrapped model; UserError naming `source` when it does not
    fill every adapter parameter."""
    peft = import_peft(source.parent)
    try:
        result = peft.set_peft_model_state_dict(adapter.model, dict(state))
    except Exception as exc:
        raise UserError(f"{source}: does not fit the adapter of model {adapter.name}: {exc}") from exc
    trainable = set(adapter.peft_trainable or ())
    missing = [k for k in result.missing_keys if k in trainable]
    if missing or result.unexpected_keys:
        shown = ", ".join((missing + list(result.unexpected_keys))[:4])
        raise UserError(f"{source}: does not match the adapter of model {adapter.name} ({shown})")
