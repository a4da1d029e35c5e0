"""Model adapters: `load_adapter(model_section, device, cache_dir)` -> `Adapter` (see base.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from gpuopt_tui.core.profiles.common import ModelSection
from gpuopt_tui.jobs.models.base import (
    Adapter,
    Batch,
    Checkpoint,
    SpecialIds,
    load_state_dict,
    select_rows,
    tile_rows,
    to_device,
)

__all__ = [
    "Adapter",
    "Batch",
    "Checkpoint",
    "SpecialIds",
    "load_adapter",
    "load_state_dict",
    "select_rows",
    "tile_rows",
    "to_device",
]


def load_adapter(model: ModelSection, device: torch.device, cache_dir: Path) -> Adapter:
    """The adapter for a profile's [model] section, with its model in eval mode on `device`.

    demo: the built-in demo (`model.demo`), trained on first use and cached under `cache_dir`/demo;
    hf: `model.path`, a local Hugging Face sequence-classification directory (never downloaded);
    plugin: `model.factory` = "package.module:function", called with device= and cache_dir=.
    """
    if model.adapter == "demo":
        from gpuopt_tui.jobs.models.demo import load_demo_adapter

        return load_demo_adapter(model.demo, device, cache_dir)
    if model.adapter == "hf":
        from gpuopt_tui.jobs.models.hf import load_hf_adapter

        return load_hf_adapter(Path(model.path).expanduser(), device)
    if model.adapter == "plugin":
        from gpuopt_tui.jobs.models.plugin import load_plugin_adapter

        return load_plugin_adapter(model.factory, device, cache_dir)
    raise ValueError(f"unknown model adapter {model.adapter!r}")  # the profile schema rejects these
