"""Schema of an Integrated Gradients attribution profile."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from gpuopt_tui.core.profiles.common import DataSection, ModelSection, ProfileBase, RunSection
from gpuopt_tui.core.profiles.schema import Failure, opt, section

IG_METHODS = ("gausslegendre", "riemann_left", "riemann_right", "riemann_middle", "riemann_trapezoid")
BASELINES = ("pad", "zero", "mask", "custom")


@dataclass
class AttributionSection:
    n_samples: int = opt(64, "How many samples of the dataset to attribute (0 = all)", min=0)
    n_steps: int = opt(50, "Interpolation steps of the path integral", min=1, max=100_000)
    method: str = opt("gausslegendre", "Integration rule", choices=IG_METHODS)
    baseline: str = opt(
        "pad",
        "Reference for the text tokens: [PAD] or [MASK] embeddings, zero vectors, or a custom token "
        "([CLS]/[SEP] and padding are kept as in the input)",
        choices=BASELINES,
    )
    custom_baseline_token: str = opt("", "Vocabulary token for every text position when baseline = custom")
    target: str = opt(
        "predicted",
        'Output to explain: "predicted", "label", or an index such as "1" (a class; a candidate for rankers)',
    )
    batch_size: int = opt(8, "Samples attributed together", min=1)
    alpha_batch_size: int | Literal["auto"] = opt(
        "auto", 'Interpolation steps per forward/backward chunk, or "auto" to fit the memory budget', min=1
    )
    use_optimized: bool = opt(
        True, "Batch samples x steps in one pass; false = one sample and one step at a time (reference)"
    )
    use_amp: bool = opt(True, "Mixed precision autocast on the GPU (ignored on CPU)")
    amp_dtype: str = opt("bf16", "Autocast dtype when use_amp is on", choices=("bf16", "fp16"))
    tf32: bool = opt(True, "Allow TF32 matrix products when running in fp32 on the GPU")
    compile: bool = opt(
        False, "Compile the model's forward with torch.compile (GPU runs: a minute of warm-up, faster steps)"
    )
    memory_fraction: float = opt(
        0.8, "Share of free GPU memory the automatic chunk size may plan for", min=0.05, max=0.98
    )
    length_bucketing: bool = opt(True, "Group samples of similar length so padding is not computed")
    top_k: int = opt(20, "Tokens listed in the overall ranking", min=1)
    top_k_sample: int = opt(20, "Tokens listed per sample", min=1)
    min_token_count: int = opt(
        3, "Tokens seen fewer times are left out of the overall ranking (their mean is noisy)", min=1
    )
    check_samples: int = opt(
        0, "Also attribute this many samples with the one-step-at-a-time path and report the difference", min=0
    )
    delta_warning: float = opt(
        0.05, "Warn when the median |convergence delta| / |F(x) - F(baseline)| exceeds this", min=0.0
    )

    def check(self, fail: Failure) -> None:
        target = self.target
        if target not in ("predicted", "label") and not target.isdigit():
            fail("target", f'expected "predicted", "label" or a class index like "1", got "{target}"')
        if self.baseline == "custom" and not self.custom_baseline_token:
            fail("custom_baseline_token", "baseline = custom needs the token to use")


@dataclass
class AttributionProfile(ProfileBase):
    kind: ClassVar[str] = "attribution"
    title: ClassVar[str] = "Integrated Gradients attribution"
    run: RunSection = section(RunSection, "How and where to run")
    model: ModelSection = section(ModelSection, "The model to explain")
    data: DataSection = section(DataSection, "The samples to attribute")
    attribution: AttributionSection = section(AttributionSection, "Integrated Gradients settings")
