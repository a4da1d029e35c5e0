"""User adapters: "package.module:function" called with device= and cache_dir=, returning an Adapter."""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.models.base import Adapter


def load_plugin_adapter(factory: str, device: torch.device, cache_dir: Path) -> Adapter:
    module_name, _, func_name = factory.partition(":")
    if not module_name or not func_name:
        raise UserError(f'model.factory "{factory}": expected "package.module:function"')
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise UserError(f'model.factory "{factory}": cannot import {module_name}: {exc}') from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        raise UserError(f'model.factory "{factory}": {module_name} has no function {func_name}')
    try:
        adapter = func(device=device, cache_dir=cache_dir)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f'model.factory "{factory}" failed: {type(exc).__name__}: {exc}') from exc
    if not isinstance(adapter, Adapter):
        raise UserError(
            f'model.factory "{factory}" returned {type(adapter).__name__}, expected a gpuopt_tui.jobs.models.Adapter'
        )
    return adapter
