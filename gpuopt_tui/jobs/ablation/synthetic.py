"""A synthetic probing data set: per-layer LoRA-like matrices where only the deeper layers know the label.

Sample i has, at every layer, a rank x dim matrix U diag(s) V^T with random orthonormal U, V, a random overall
scale and singular values s_j = j^(-alpha). The decay exponent alpha comes from a class: at layers from
`signal_layer` on, the sample's own label; at earlier layers, a class drawn independently of the label. Every
layer therefore looks alike on its own, but only the layers from `signal_layer` on carry information about
the label, and it lies in the shape of the spectrum (effective rank), not in any fixed direction. A probe
should be at chance before `signal_layer` and well above it from there on: a correctness check of the whole
pipeline with a known answer, generated deterministically from the seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ALPHA_BASE = 0.3  # decay exponent of class 0
ALPHA_STEP = 0.5  # added per class
ALPHA_NOISE = 0.15  # per-sample spread of the exponent (keeps the classes from being perfectly separable)
SCALE_NOISE = 0.5  # log-normal spread of the overall scale (norms alone carry no class information)


@dataclass(frozen=True)
class SyntheticSpec:
    samples: int = 2000
    layers: int = 12
    signal_layer: int = 6
    rank: int = 8
    dim: int = 64
    classes: int = 2
    seed: int = 0


def layer_name(index: int) -> str:
    return f"layer.{index}"


def generate(spec: SyntheticSpec) -> tuple[dict[str, Tensor], Tensor]:
    """({layer name: [samples, rank, dim] float32}, labels [samples] int64)."""
    gen = torch.Generator().manual_seed(spec.seed)
    labels = torch.arange(spec.samples) % spec.classes
    labels = labels[torch.randperm(spec.samples, generator=gen)]
    decay = torch.arange(1, spec.rank + 1, dtype=torch.float64)
    layers: dict[str, Tensor] = {}
    for index in range(spec.layers):
        if index >= spec.signal_layer:
            cls = labels
        else:
            cls = torch.randint(spec.classes, (spec.samples,), generator=gen)
        alpha = ALPHA_BASE + ALPHA_STEP * cls + ALPHA_NOISE * torch.randn(spec.samples, generator=gen)
        scale = torch.exp(SCALE_NOISE * torch.randn(spec.samples, 1, generator=gen))
        svals = scale * decay.unsqueeze(0) ** -alpha.unsqueeze(1).double()
        u = torch.linalg.qr(torch.randn(spec.samples, spec.rank, spec.rank, generator=gen, dtype=torch.float64)).Q
        v = torch.linalg.qr(torch.randn(spec.samples, spec.dim, spec.rank, generator=gen, dtype=torch.float64)).Q
        layers[layer_name(index)] = ((u * svals.unsqueeze(1)) @ v.mT).float()
    return layers, labels
