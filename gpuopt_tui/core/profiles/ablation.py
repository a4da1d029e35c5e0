"""Schema of a layer ablation / probing profile."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from gpuopt_tui.core.profiles.common import DataSection, ModelSection, ProfileBase, ScaledRunSection
from gpuopt_tui.core.profiles.schema import Failure, opt, section

#: Per-layer representation functions (jobs/ablation/representations.py implements them).
BASE_REPRESENTATIONS = ("mean_pool", "last_token", "svd_topk", "spectrum_stats", "random_projection")
#: Suffixes of the all-layers variants: one probe on every probed layer, or on layers 0..l at each layer l.
VARIANTS = ("_all_layers", "_cumulative")
REPRESENTATIONS = (*BASE_REPRESENTATIONS, *(b + v for v in VARIANTS for b in BASE_REPRESENTATIONS))
DEFAULT_REPRESENTATIONS = (*BASE_REPRESENTATIONS, "svd_topk_cumulative", "spectrum_stats_all_layers")
SOURCES = ("model", "files", "lora", "synthetic")


def split_representation(name: str) -> tuple[str, str]:
    """(base, variant suffix or "") of a representation name; ValueError for unknown names."""
    for variant in VARIANTS:
        if name.endswith(variant) and name[: -len(variant)] in BASE_REPRESENTATIONS:
            return name[: -len(variant)], variant
    if name in BASE_REPRESENTATIONS:
        return name, ""
    raise ValueError(name)


@dataclass
class AblationSection:
    source: str = opt(
        "model",
        "model: hidden states of [model] over [data]; files: per-layer tensors at features_path; lora: the "
        "lora_A/lora_B matrices of a state dict at features_path; synthetic: generated LoRA-like matrices "
        "whose layers from synthetic_signal_layer on carry the label",
        choices=SOURCES,
    )
    features_path: str = opt(
        "",
        "files: a .safetensors file (one [N, ...] tensor per layer) or a folder of .pt/.npy files, one per layer; "
        "lora: a .safetensors/.pt state dict whose lora_A/lora_B tensors have the sample dimension first",
    )
    labels_path: str = opt("", "Labels [N] (.npy, .pt, .safetensors); default: a 'labels' tensor in the file or folder")
    lora_part: str = opt(
        "product", "lora: probe the update B @ A (kept factored), or the A or B matrices", choices=("product", "A", "B")
    )
    representations: list[str] = opt(list(DEFAULT_REPRESENTATIONS), "Representation functions to compare")
    n_samples: int = opt(0, "Samples used, the first ones (0 = all)", min=0)
    layer_fraction: float = opt(1.0, "Share of layers probed, evenly spaced (layer sampling)", min=0.01, max=1.0)
    top_k: int = opt(10, "Singular values kept by svd_topk", min=1)
    svd_oversample: int = opt(10, "Extra subspace vectors of the randomized SVD (accuracy of svd_topk)", min=0)
    svd_niter: int = opt(4, "Power iterations of the randomized SVD (accuracy of svd_topk)", min=0, max=20)
    projection_dim: int = opt(10, "Random directions of random_projection", min=1)
    extract_batch_size: int = opt(64, "Samples per feature-extraction batch", min=1)
    val_fraction: float = opt(0.15, "Share of samples for validation (early stopping)", min=0.01, max=0.5)
    test_fraction: float = opt(0.15, "Share of samples for the reported test accuracy", min=0.01, max=0.5)
    hidden_dim: int = opt(512, "Hidden width of the MLP probe", min=1)
    dropout: float = opt(0.5, "Dropout of the MLP probe", min=0.0, max=0.95)
    weight_decay: float = opt(1e-4, "AdamW weight decay of the probe", min=0.0)
    learning_rate: float = opt(1e-3, "Probe learning rate", min=1e-7, max=10.0)
    batch_size: int = opt(256, "Probe training batch size", min=1)
    max_epochs: int = opt(200, "Probe training epochs at most", min=1)
    patience: int = opt(10, "Early stopping: epochs without a lower validation loss", min=1)
    num_runs: int = opt(10, "Seeds per probe (mean and std reported)", min=1)
    quick: bool = opt(False, "Quick mode: 3 seeds per probe")
    use_amp: bool = opt(True, "Mixed precision for probe training on the GPU (ignored on the CPU)")
    amp_dtype: str = opt("bf16", "Autocast dtype when use_amp is on", choices=("bf16", "fp16"))
    use_cache: bool = opt(True, "Reuse cached features when inputs and settings are unchanged")
    synthetic_samples: int = opt(2000, "synthetic: samples generated", min=20)
    synthetic_layers: int = opt(12, "synthetic: layers generated", min=1)
    synthetic_signal_layer: int = opt(6, "synthetic: first layer whose spectrum depends on the label", min=0)
    synthetic_rank: int = opt(8, "synthetic: rank of each LoRA-like matrix", min=2)
    synthetic_dim: int = opt(64, "synthetic: columns of each LoRA-like matrix", min=2)
    synthetic_classes: int = opt(2, "synthetic: number of classes", min=2, max=10)

    def check(self, fail: Failure) -> None:
        if self.source in ("files", "lora") and not self.features_path:
            fail("features_path", f"source = {self.source} needs features_path")
        if not self.representations:
            fail("representations", "expected at least one representation")
        for i, name in enumerate(self.representations):
            try:
                split_representation(name)
            except ValueError:
                fail(
                    f"representations[{i}]",
                    f'unknown representation "{name}" (expected one of {", ".join(BASE_REPRESENTATIONS)}, '
                    f"optionally followed by {' or '.join(VARIANTS)})",
                )
        if len(set(self.representations)) != len(self.representations):
            fail("representations", "a representation is listed twice")
        if self.val_fraction + self.test_fraction > 0.8:
            fail("test_fraction", "val_fraction + test_fraction must leave at least 20% for training")
        if self.synthetic_signal_layer >= self.synthetic_layers:
            fail("synthetic_signal_layer", f"expected a layer below synthetic_layers ({self.synthetic_layers})")
        if self.synthetic_rank > self.synthetic_dim:
            fail("synthetic_rank", f"expected at most synthetic_dim ({self.synthetic_dim})")


@dataclass
class AblationProfile(ProfileBase):
    kind: ClassVar[str] = "ablation"
    title: ClassVar[str] = "Layer ablation and probing"
    run: ScaledRunSection = section(ScaledRunSection, "How and where to run")
    model: ModelSection = section(ModelSection, "The model whose layers are probed (source = model)")
    data: DataSection = section(DataSection, "Samples and labels (source = model)")
    ablation: AblationSection = section(AblationSection, "Probing settings")
