"""Schema of a layer ablation / probing profile."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from gpuopt_tui.core.profiles.common import DataSection, ModelSection, ProfileBase, RunSection
from gpuopt_tui.core.profiles.schema import opt, section

REPRESENTATIONS = ("mean_pool", "last_token", "svd_topk", "spectrum_stats", "concat_all", "random_projection")


@dataclass
class AblationSection:
    source: str = opt(
        "model",
        "model: hidden states extracted from [model] over [data]; files: per-layer tensors at features_path",
        choices=("model", "files"),
    )
    features_path: str = opt("", "safetensors file or folder of per-layer .pt/.npy files (source = files)")
    representations: list[str] = opt(list(REPRESENTATIONS), "Representation functions to compare")
    n_samples: int = opt(0, "Samples used (0 = all)", min=0)
    top_k: int = opt(10, "Singular values kept by svd_topk", min=1)
    layer_fraction: float = opt(1.0, "Share of layers probed (layer sampling)", min=0.01, max=1.0)
    hidden_dim: int = opt(128, "Hidden width of the MLP probe", min=1)
    dropout: float = opt(0.1, "Dropout of the MLP probe", min=0.0, max=0.95)
    weight_decay: float = opt(1e-4, "AdamW weight decay of the probe", min=0.0)
    learning_rate: float = opt(1e-3, "Probe learning rate", min=1e-7, max=10.0)
    max_epochs: int = opt(100, "Probe training epochs at most", min=1)
    patience: int = opt(10, "Early stopping: epochs without validation gain", min=1)
    num_runs: int = opt(5, "Seeds per probe (mean and std reported)", min=1)
    quick: bool = opt(False, "Quick mode: 3 seeds and at most 30 epochs")
    use_amp: bool = opt(True, "Mixed precision for probes and features on the GPU")
    use_cache: bool = opt(True, "Reuse cached features when inputs and settings are unchanged")


@dataclass
class AblationProfile(ProfileBase):
    kind: ClassVar[str] = "ablation"
    title: ClassVar[str] = "Layer ablation and probing"
    run: RunSection = section(RunSection, "How and where to run")
    model: ModelSection = section(ModelSection, "The model whose layers are probed")
    data: DataSection = section(DataSection, "Samples and labels")
    ablation: AblationSection = section(AblationSection, "Probing settings")
