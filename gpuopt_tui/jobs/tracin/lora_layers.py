"""PEFT LoRA layers in the factored projection: both adapter matrices of a layer from its input and output gradient.

A LoRA layer computes y = base(x) + s B A x (A: [r, in], B: [out, r], s: the adapter's scaling). With g = dL/dy, an
example's gradients are dL/dB = s sum_t g_t (A x_t)^T and dL/dA = s sum_t (B^T g_t) x_t^T, so their projections
need only x and g, through fixed matrices: P_Bo^T g_t and (s A^T P_Bi)^T x_t for B, (s B P_Ao)^T g_t and P_Ai^T x_t
for A (P: the projection factors of each matrix's output and input side, the identity on an exact side). One hook
on the layer replaces the hooks on its lora_A and lora_B sub-layers; the projected gradients are the same numbers
(up to rounding) in the same layout.

While the gradients are taken the layer also runs without PEFT's forward, as base(x) + (B (A x)) s in the input's
own precision: the same products in the same order, minus the fp32 copy of x that PEFT makes for fp32 adapter
weights under autocast (and the copies back in the backward), which took about a fifth of a 1B decoder's micro-batch
on an H200 (benchmarks/results/tracin_lm_microbatch_H200.md). Without autocast, when x's dtype is not the adapter's,
PEFT's forward runs (the products need one dtype).

The attributes read here (`lora_A`, `lora_B`, `scaling`, `active_adapters`, `merged`, `lora_variant`, ...) are
PEFT's public layer attributes; a layer missing any of them, or using a LoRA variant (DoRA and the like), a bias on
B, dropout in training mode or several active adapters, keeps PEFT's forward and the hooks on its sub-layers.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class LoraLayer:
    """One PEFT LoRA layer whose two adapter matrices are both chosen: `a`, `b` name their weights."""

    module: nn.Module
    a: str
    b: str
    scaling: float

    def matrices(self) -> tuple[Tensor, Tensor]:
        adapter = self.module.active_adapters[0]
        return self.module.lora_A[adapter].weight, self.module.lora_B[adapter].weight


def lora_layers(model: nn.Module, names: Sequence[str]) -> dict[str, LoraLayer]:
    """Module name -> its LoRA layer, for the plain PEFT LoRA Linear layers of `model` whose A and B weights are
    both in `names` and whose base layer has no parameter in `names` (see the module docstring)."""
    if "peft" not in sys.modules:  # a model wrapped by PEFT imported it
        return {}
    try:
        from peft.tuners.lora.layer import Linear as PeftLoraLinear
    except ImportError:
        return {}
    wanted = set(names)
    canonical = {id(p): n for n, p in model.named_parameters()}
    found: dict[str, LoraLayer] = {}
    for mod_name, module in model.named_modules():
        if type(module) is not PeftLoraLinear or not _plain(module):
            continue
        adapter = module.active_adapters[0]
        a = canonical.get(id(module.lora_A[adapter].weight))
        b = canonical.get(id(module.lora_B[adapter].weight))
        base_chosen = any(canonical.get(id(p)) in wanted for p in module.base_layer.parameters())
        if a in wanted and b in wanted and not base_chosen:
            found[mod_name] = LoraLayer(module, a, b, float(module.scaling[adapter]))
    return found


def variant_parameters(model: nn.Module, names: Sequence[str]) -> dict[str, str]:
    """Chosen parameter -> why the factored products would get it wrong, for the parameters of LoRA layers with a
    variant (DoRA and the like): their output also depends on A and B through a weight norm (DoRA calls its
    sub-layers on an identity matrix for it), which hooks on the sub-layers' inputs and outputs do not see."""
    wanted = set(names)
    why: dict[str, str] = {}
    for mod_name, module in model.named_modules():
        if not _has_variant(module):
            continue
        for name, _ in module.named_parameters(prefix=mod_name):
            if name in wanted and not name.startswith(f"{mod_name}.base_layer."):
                why[name] = f"{mod_name}: a LoRA variant (DoRA or the like), whose weight norm hooks do not see"
    return why


def _has_variant(module: nn.Module) -> bool:
    variants = getattr(module, "lora_variant", None) or {}
    dora = getattr(module, "use_dora", None) or {}
    return isinstance(variants, dict) and isinstance(dora, dict) and bool(variants or any(dora.values()))


def _plain(module: nn.Module) -> bool:
    """Whether the layer computes base(x) + s B A x with one adapter (see the module docstring)."""
    try:
        adapters = list(module.active_adapters)
        if module.merged or module.disable_adapters or len(adapters) != 1:
            return False
        adapter = adapters[0]
        dropout = module.lora_dropout[adapter]
        return (
            adapter in module.lora_A
            and not _has_variant(module)
            and not getattr(module, "lora_bias", {}).get(adapter, False)
            and module.lora_B[adapter].bias is None
            and (isinstance(dropout, nn.Identity) or not dropout.training)
        )
    except (AttributeError, KeyError, TypeError):
        return False


@contextlib.contextmanager
def plain_forwards(layers: Mapping[str, LoraLayer]) -> Iterator[None]:
    """Run each layer as base(x) + (B (A x)) s while the block runs, where that takes x's own precision (under
    autocast, or adapter weights of x's dtype); PEFT's forward otherwise, and again after the block. A layer with a
    forward of its own on the instance (another library's hook) is left alone."""
    replaced = [layer for layer in layers.values() if "forward" not in vars(layer.module)]
    for layer in replaced:
        layer.module.forward = _forward_of(layer)
    try:
        yield
    finally:
        for layer in replaced:
            del layer.module.forward


def _forward_of(layer: LoraLayer) -> Callable[..., Tensor]:
    module = layer.module
    peft_forward = type(module).forward

    def forward(x: Tensor, *args: object, **kwargs: object) -> Tensor:
        a, b = layer.matrices()
        if args or kwargs or not (torch.is_autocast_enabled(x.device.type) or x.dtype == a.dtype):
            return peft_forward(module, x, *args, **kwargs)
        delta = F.linear(F.linear(x, a), b)
        return module.base_layer(x) + (delta * layer.scaling if layer.scaling != 1 else delta)

    return forward
