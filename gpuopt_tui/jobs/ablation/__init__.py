"""Layer ablation / probing: per-layer representations, the feature cache, batched MLP probes and the job.

As a library::

    source = files_source(Path("layers.safetensors"), "", 0, FeatureCache())
    features = extract(source, ["svd_topk"], source.layers, FeatureSettings(), FeatureCache(), device, 256)
    split = stratified_split(source.labels, 0.15, 0.15, seed=0)
    table = FeatureTable([features["svd_topk", layer].array for layer in source.layers], split.train, device, True)
    results = train_probes(table, source.labels, split, source.classes, ProbeSettings())  # [layer][seed]
"""

from gpuopt_tui.jobs.ablation.features import LayerFeatures, extract
from gpuopt_tui.jobs.ablation.inputs import (
    LayerSource,
    files_source,
    lora_source,
    model_source,
    open_source,
    synthetic_source,
)
from gpuopt_tui.jobs.ablation.matrices import DenseBatch, LowRankProductBatch, MatrixBatch
from gpuopt_tui.jobs.ablation.probe import (
    EnsembleMLP,
    FeatureTable,
    MemberResult,
    ProbeSettings,
    Split,
    fit_standardizer,
    stratified_split,
    train_probes,
)
from gpuopt_tui.jobs.ablation.representations import BASES, FeatureSettings, spectrum_statistics
from gpuopt_tui.jobs.ablation.synthetic import SyntheticSpec

__all__ = [
    "BASES",
    "DenseBatch",
    "EnsembleMLP",
    "FeatureSettings",
    "FeatureTable",
    "LayerFeatures",
    "LayerSource",
    "LowRankProductBatch",
    "MatrixBatch",
    "MemberResult",
    "ProbeSettings",
    "Split",
    "SyntheticSpec",
    "extract",
    "files_source",
    "fit_standardizer",
    "lora_source",
    "model_source",
    "open_source",
    "spectrum_statistics",
    "stratified_split",
    "synthetic_source",
    "train_probes",
]
