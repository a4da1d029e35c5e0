"""Which parameters TracIn differentiates: all of them, the last N modules the forward pass runs, or named
modules (or single parameters)."""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.tracin import LAYER_MODES
from gpuopt_tui.jobs.models.base import Adapter


def modules_in_call_order(adapter: Adapter, batch: Mapping[str, Tensor]) -> list[str]:
    """Names of the modules that own parameters directly, in the order a forward pass first calls them.

    Registration order need not match execution order (a model may define its head before its trunk), so
    "the last N layers" is read off one real forward of `batch`.
    """
    owners = {name: mod for name, mod in adapter.model.named_modules() if next(mod.parameters(False), None) is not None}
    order: list[str] = []

    def hook_for(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: object, output: object) -> None:
            if name not in order:
                order.append(name)

        return hook

    handles = [mod.register_forward_hook(hook_for(name)) for name, mod in owners.items()]
    try:
        with torch.no_grad():
            adapter.logits(batch)
    finally:
        for handle in handles:
            handle.remove()
    return order


def select_parameters(
    adapter: Adapter,
    batch: Mapping[str, Tensor],
    layers: str,
    n_last: int = 1,
    names: Sequence[str] = (),
) -> list[str]:
    """Parameter names (as `model.named_parameters()` gives them, in that order) that count.

    layers = "all": every parameter; "last": those of the last `n_last` parameter-owning modules the forward
    of `batch` calls; "names": those under each module name in `names` (a parameter name also works); "adapter":
    the PEFT adapter's trainable ones (the model wrapped for adapter checkpoints); "auto": see `resolved_layers`.
    """
    model = adapter.model
    canonical = {id(p): n for n, p in model.named_parameters()}  # tied weights: the first name wins
    layers = resolved_layers(adapter, layers)[0]
    if layers == "adapter":
        if adapter.peft_trainable is None:
            raise UserError(
                'layers = "adapter" needs PEFT adapter checkpoints (directories with adapter_model.safetensors and '
                "adapter_config.json); these checkpoints are full state dicts"
            )
        chosen = set(adapter.peft_trainable)
    elif layers == "all":
        chosen = set(canonical.values())
    elif layers == "last":
        order = modules_in_call_order(adapter, batch)
        if n_last > len(order):
            raise UserError(
                f"n_last_layers = {n_last}, but the forward pass uses only {len(order)} modules with parameters"
            )
        modules = dict(model.named_modules())
        chosen = {canonical[id(p)] for name in order[-n_last:] for p in modules[name].parameters(False)}
    elif layers == "names":
        chosen = set()
        for name in names:
            chosen |= _named(model, name, canonical)
    else:
        raise UserError(f"layers must be one of {', '.join(LAYER_MODES)}, got {layers!r}")
    return [n for n in canonical.values() if n in chosen]


def resolved_layers(adapter: Adapter, layers: str) -> tuple[str, str]:
    """The mode `layers` stands for ("auto": "adapter" when the model is wrapped in a PEFT adapter for adapter
    checkpoints, else "last"), and where that choice came from, for the summary and the log."""
    if layers != "auto":
        return layers, f"tracin.layers = {layers}"
    if adapter.peft_trainable is not None:
        return "adapter", "tracin.layers = auto, as the checkpoints are PEFT adapters"
    return "last", "tracin.layers = auto, as the checkpoints are full state dicts"


def _named(model: nn.Module, name: str, canonical: Mapping[int, str]) -> set[str]:
    modules = dict(model.named_modules())
    if name in modules and name:
        found = {canonical[id(p)] for p in modules[name].parameters()}
        if not found:
            raise UserError(f'layer_names: module "{name}" has no parameters')
        return found
    params = dict(model.named_parameters(remove_duplicate=False))
    if name in params:
        return {canonical[id(params[name])]}
    close = difflib.get_close_matches(name, [*modules, *params], n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise UserError(f'layer_names: "{name}" is neither a module nor a parameter of the model{hint}')


@contextlib.contextmanager
def only_these_require_grad(model: nn.Module, names: Sequence[str]) -> Iterator[None]:
    """Let autograd track only `names`: everything else runs as if under no_grad (no graph is kept for the
    trunk below the first chosen layer). Flags are restored afterwards."""
    wanted = set(names)
    params = list(model.named_parameters())
    flags = [p.requires_grad for _, p in params]
    for n, p in params:
        p.requires_grad_(n in wanted)
    try:
        yield
    finally:
        for (_, p), flag in zip(params, flags):
            p.requires_grad_(flag)


def count_parameters(model: nn.Module, names: Sequence[str]) -> int:
    params = dict(model.named_parameters())
    return sum(params[n].numel() for n in names)
