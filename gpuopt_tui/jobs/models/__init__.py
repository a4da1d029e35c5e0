"""Model adapters: `load_adapter(model_section, device, cache_dir)` -> `Adapter` (see base.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from gpuopt_tui.core.profiles.common import ModelSection
from gpuopt_tui.jobs.context import LOAD_STAGE, StageFn, no_stage
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


def load_adapter(model: ModelSection, device: torch.device, cache_dir: Path, stage: StageFn = no_stage) -> Adapter:
    """The adapter for a profile's [model] section, with its model in eval mode on `device`; `stage` hears
    LOAD_STAGE, and for a demo built now its training.

    demo: the built-in demo (`model.demo`), trained on first use and cached under `cache_dir`/demo;
    hf: `model.path`, a local Hugging Face directory (never downloaded): a sequence classifier, or a causal LM when
    its config.json names a causal LM architecture;
    plugin: `model.factory` = "package.module:function", called with device= and cache_dir=.
    """
    stage(LOAD_STAGE)
    if model.adapter == "demo":
        from gpuopt_tui.jobs.models.demo import load_demo_adapter

        return load_demo_adapter(model.demo, device, cache_dir, stage=stage)
    if model.adapter == "hf":
        from gpuopt_tui.jobs.models.hf import load_hf_adapter

        return load_hf_adapter(Path(model.path).expanduser(), device, stage)
    if model.adapter == "plugin":
        from gpuopt_tui.jobs.models.plugin import load_plugin_adapter

        return load_plugin_adapter(model.factory, device, cache_dir)
    raise ValueError(f"unknown model adapter {model.adapter!r}")  # the profile schema rejects these
