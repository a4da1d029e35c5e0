"""Schema of an Integrated Gradients attribution profile."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, Literal

from gpuopt_tui.core.profiles.common import DataSection, ModelSection, ProfileBase, ScaledRunSection
from gpuopt_tui.core.profiles.schema import Failure, opt, section

IG_METHODS = (
    "gausslegendre",
    "riemann_left",
    "riemann_right",
    "riemann_middle",
    "riemann_trapezoid",
    "clenshaw_curtis",
)
BASELINES = ("pad", "zero", "zero-all", "mask", "unk", "custom")
COMPILE_CHOICES = ("auto", "on", "off")


@dataclass
class AttributionSection:
    n_samples: int = opt(64, "How many samples of the dataset to attribute (0 = all)", min=0)
    n_steps: int | Literal["auto"] = opt(
        50,
        'Interpolation steps of the path integral, or "auto": each sample is refined on adaptive Simpson panels '
        "(17, 25, 33, ... points, placed where its error is; `method` unused) until its relative convergence delta "
        "and the error estimate of its token scores are within `tolerance`, or it reaches `max_steps`",
        min=1,
        max=100_000,
    )
    tolerance: float = opt(
        1e-2,
        'With n_steps = "auto": the |convergence delta| / |F(x) - F(baseline)| a sample must reach, and the '
        "error estimate of its token scores / their max |score|; a sample is reported within it only when both "
        "figures written for it are (`within_tolerance` in attributions.jsonl)",
        min=1e-9,
        max=1.0,
    )
    max_steps: int = opt(
        1025,
        "With n_steps = auto: the cap on a sample's steps (17, then 8 more per pass; it stops at the last within it)",
        min=17,
        max=100_000,
    )
    method: str = opt("gausslegendre", "Integration rule", choices=IG_METHODS)
    baseline: str = opt(
        "pad",
        "Reference for the text tokens: [PAD], [MASK] or [UNK] embeddings, zero vectors, or a custom token "
        "([CLS]/[SEP] and padding are kept as in the input); zero-all: zero vectors at every position, [CLS]/[SEP] "
        "included (Captum's default baseline)",
        choices=BASELINES,
    )
    custom_baseline_token: str = opt("", "Vocabulary token for every text position when baseline = custom")
    target: str = opt(
        "predicted",
        'Output to explain: "predicted", "label", or an index such as "1" (a class; a candidate for rankers). '
        'Causal LMs: "predicted" explains the completion in data.target_field, "generate" the model\'s own greedy '
        "continuation of up to max_new_tokens tokens (written to the results)",
    )
    batch_size: int = opt(
        32,
        "Samples attributed together (a shard each); larger batches make larger, faster matrix products "
        "(BERT-base, 50 steps, H200: 32 runs 1.2x the speed of 8; with torch.compile 64 runs 1.05x the speed of 32; "
        "auto steps refine few points per pass: through gpuopt-tui run on an H100, 128 ran 1.5x the rate of 32)",
        min=1,
    )
    alpha_batch_size: int | Literal["auto"] = opt(
        "auto", 'Interpolation steps per forward/backward chunk, or "auto" to fit the memory budget', min=1
    )
    use_optimized: bool = opt(
        True, "Batch samples x steps in one pass; false = one sample and one step at a time (reference)"
    )
    use_amp: bool = opt(
        True,
        "Reduced precision for the interpolation steps on the GPU (ignored on CPU); F(x) and F(baseline) stay "
        "fp32/TF32",
    )
    amp_dtype: str = opt(
        "fp16",
        "Reduced-precision dtype when use_amp is on. fp16: as fast as bf16 and half its error (BERT-base: "
        "rel. error vs fp32 4e-3 against 8e-3); a batch whose fp16 gradients overflow is redone in bf16",
        choices=("bf16", "fp16"),
    )
    amp_mode: str = opt(
        "weights",
        "How use_amp runs the steps. weights: on a copy of the weights in amp_dtype, without autocast (fastest: "
        "1.3x autocast on BERT-base); autocast: fp32 weights under torch.autocast (matrix products in amp_dtype, "
        "LayerNorm and residuals in fp32)",
        choices=("weights", "autocast"),
    )
    full_precision_fallback: bool = opt(
        True,
        'With n_steps = "auto" on the GPU: the steps of a sample start over in a fuller precision (amp_dtype, then '
        "TF32 -- fp32 below a tolerance of 1e-3 --, then fp32) when the rounding measured on two of its first points "
        "against it would take half the tolerance, or, from amp_dtype, when its output moves too little between "
        "baseline and input for amp_dtype's rounding or it has not settled in 129 points; and whole batches start "
        "in TF32/fp32 where the run measures amp_dtype no faster once those restarts are counted (a small model); "
        "the summary counts them by reason and attributions.jsonl marks them (`full_precision`, "
        "`full_precision_reason`)",
    )
    tf32: bool = opt(True, "Allow TF32 matrix products when running in fp32 on the GPU")
    compile: str = opt(
        "auto",
        "torch.compile the forward of the steps on the GPU: on, off, or auto = on for runs of at least 5 "
        "million samples x steps (steps 5-8% faster on BERT-base, for up to half a minute of compiling); falls back "
        "to eager if compiling fails",
        choices=COMPILE_CHOICES,
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
    audit_samples: int | Literal["auto"] = opt(
        "auto",
        "Samples chosen at random (and named) that the run attributes again with a strict fp32 reference on the "
        "model's own forward, reporting their error against the tolerance (summary.json, the outcome, the Summary "
        'tab); "auto" = 4 on a GPU, 2 on the CPU; 0 turns the audit off. Its cost is reported',
        min=0,
        max=10_000,
    )
    check_samples: int = opt(
        0, "Also attribute this many samples with the one-step-at-a-time path and report the difference", min=0
    )
    delta_warning: float = opt(
        0.05,
        "Warn when the median |convergence delta| / |F(x) - F(baseline)| exceeds this, or the 95th percentile of "
        "|convergence delta| / the median |F(x) - F(baseline)| does",
        min=0.0,
    )
    max_new_tokens: int = opt(16, 'Causal LMs with target = "generate": tokens generated per prompt at most', min=1)
    per_target_token: bool = opt(
        False,
        "Causal LMs: also attribute each completion token's own log-probability, giving a [completion, prompt] "
        "matrix per sample (one attribution per completion token: that many times the work)",
    )

    def check(self, fail: Failure) -> None:
        target = self.target
        if target not in ("predicted", "label", "generate") and not target.isdigit():
            fail("target", f'expected "predicted", "label", "generate" or a class index like "1", got "{target}"')
        if self.n_steps == "auto" and not self.use_optimized:
            fail("n_steps", 'n_steps = "auto" needs use_optimized = true (the one-step-at-a-time path has fixed steps)')
        if self.baseline == "custom" and not self.custom_baseline_token:
            fail("custom_baseline_token", "baseline = custom needs the token to use")


@dataclass
class CompletionDataSection(DataSection):
    """The data of an attribution or TracIn run: a causal LM's also name its completions."""

    target_field: str = opt(
        "completion",
        "Causal LMs: column or key holding the completion that follows the prompt (text_field): attribution explains "
        'its log-probability (not needed with attribution.target = "generate"), TracIn\'s loss is the mean cross '
        "entropy of its tokens",
    )
    chat_template: bool = opt(
        False, "Causal LMs: pass each prompt as a user message through the tokenizer's chat template"
    )
    messages_field: str = opt(
        "",
        'Causal LMs: key holding each row\'s chat messages, a list of {"role", "content"} objects ending with the '
        "assistant's (jsonl only); empty = off. The prompt is the tokenizer's chat template over the messages before "
        "the last (with the generation prompt), the completion the last message's content; text_field and "
        'target_field are not read. Results show the prompt as "role: content" lines',
    )

    def check(self, fail: Failure) -> None:
        super().check(fail)
        if not self.messages_field:
            return
        defaults = {f.name: f.default for f in fields(self)}
        for key in ("text_field", "target_field"):
            if getattr(self, key) != defaults[key]:
                why = f'the prompt and completion come from the messages in "{self.messages_field}"'
                fail(key, f"not read when data.messages_field is set ({why}): leave {key} out or messages_field empty")


@dataclass
class AttributionProfile(ProfileBase):
    kind: ClassVar[str] = "attribution"
    title: ClassVar[str] = "Integrated Gradients attribution"
    run: ScaledRunSection = section(ScaledRunSection, "How and where to run")
    model: ModelSection = section(ModelSection, "The model to explain")
    data: CompletionDataSection = section(CompletionDataSection, "The samples to attribute")
    attribution: AttributionSection = section(AttributionSection, "Integrated Gradients settings")
