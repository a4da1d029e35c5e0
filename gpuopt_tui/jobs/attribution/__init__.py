"""Integrated Gradients over input embeddings: the batched engine, its reference loop and the job."""

from gpuopt_tui.jobs.attribution.chunking import ChunkPlanner
from gpuopt_tui.jobs.attribution.common import IGResult
from gpuopt_tui.jobs.attribution.ig import integrated_gradients
from gpuopt_tui.jobs.attribution.options import IGOptions
from gpuopt_tui.jobs.attribution.reference import integrated_gradients_reference
from gpuopt_tui.jobs.attribution.rules import METHODS, step_rule

__all__ = [
    "METHODS",
    "ChunkPlanner",
    "IGOptions",
    "IGResult",
    "integrated_gradients",
    "integrated_gradients_reference",
    "step_rule",
]
