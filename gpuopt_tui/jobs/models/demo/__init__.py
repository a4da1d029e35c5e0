"""The built-in demo models: trained on first use in seconds on the CPU, cached under the user cache dir.

`demo_bundle(kind, cache_dir)` builds (or finds) a demo's cache directory; `load_demo_adapter` wraps it in an
adapter whose `builtin_dataset("train" | "test")` is the demo data, `checkpoints` the training checkpoints
with their learning rates, and `info` the oracle facts (signal tokens, flipped train labels, accuracy).
See classifier.py, two_tower.py and language_model.py for what each demo's data plants.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.context import LOAD_STAGE, StageFn, no_stage
from gpuopt_tui.jobs.models.base import Adapter
from gpuopt_tui.jobs.models.demo import classifier, language_model, two_tower
from gpuopt_tui.jobs.models.demo.bundle import DemoBundle
from gpuopt_tui.jobs.models.demo.cache import ensure_built
from gpuopt_tui.jobs.models.demo.train import one_thread

__all__ = ["KINDS", "DemoBundle", "demo_bundle", "demo_root", "load_demo_adapter"]

BUILD_STAGE = "building the demo model (first use)"
WAIT_STAGE = "waiting for another process building the demo model"

#: kind -> (module with build(root, seed, on_step) and the adapter class, cache version)
KINDS = {"classifier": (classifier, 1), "two_tower": (two_tower, 1), "causal_lm": (language_model, 1)}


def demo_root(kind: str, cache_dir: Path, seed: int = 0) -> Path:
    _, version = _kind(kind)
    suffix = f"-seed{seed}" if seed else ""
    return Path(cache_dir) / "demo" / f"{kind}-v{version}{suffix}"


def demo_bundle(
    kind: str = "classifier", cache_dir: Path | None = None, seed: int = 0, stage: StageFn = no_stage
) -> DemoBundle:
    """The demo `kind` (a key of KINDS), trained now unless a complete cache exists; `stage` hears
    of the training (BUILD_STAGE, in optimizer steps) and of a wait for another process building it."""
    if cache_dir is None:
        from gpuopt_tui.core.paths import cache_dir as default_cache_dir

        cache_dir = default_cache_dir()
    module, version = _kind(kind)
    root = demo_root(kind, cache_dir, seed)

    def build(tmp: Path) -> dict[str, object]:
        stage(BUILD_STAGE)
        return module.build(tmp, seed, lambda done, total: stage(BUILD_STAGE, done, total, "training steps"))

    with one_thread():
        manifest, built = ensure_built(root, version, build, on_wait=lambda: stage(WAIT_STAGE))
    return DemoBundle(kind, root, manifest, built)


def load_demo_adapter(
    kind: str, device: torch.device, cache_dir: Path, seed: int = 0, stage: StageFn = no_stage
) -> Adapter:
    module, _ = _kind(kind)
    bundle = demo_bundle(kind, cache_dir, seed, stage)
    stage(LOAD_STAGE)
    return module.DemoAdapter(bundle, device, stage)


def _kind(kind: str) -> tuple[object, int]:
    if kind not in KINDS:
        raise UserError(f'demo model "{kind}": expected one of {", ".join(KINDS)}')
    module, version = KINDS[kind]
    return module, version
