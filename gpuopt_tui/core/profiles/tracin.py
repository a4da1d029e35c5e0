"""Schema of a TracIn influence profile."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from gpuopt_tui.core.profiles.attribution import CompletionDataSection
from gpuopt_tui.core.profiles.common import ModelSection, ProfileBase, ScaledRunSection
from gpuopt_tui.core.profiles.schema import Failure, opt, section

LAYER_MODES = ("auto", "adapter", "all", "last", "names")
GRADIENT_METHODS = ("auto", "closed_form", "vmap", "factored")
FILTER_CHOICES = ("none", "same_label", "shared_entity")
OPTIMIZER_STATES = ("off", "adam")
PROJECTION_BASES = ("random", "pca")


@dataclass
class CheckpointSpec:
    path: str = opt(
        "",
        "State-dict file (.safetensors, or a torch file loaded with weights_only=True), or a PEFT adapter directory "
        "(adapter_model.safetensors + adapter_config.json) on [model] as the base model",
    )
    lr: float = opt(1.0, "Learning rate in effect when this checkpoint was saved", min=0.0)

    def check(self, fail: Failure) -> None:
        if not self.path:
            fail("path", "each checkpoint needs path = its state-dict file or PEFT adapter directory")


@dataclass
class TracInSection:
    checkpoints: list[CheckpointSpec] = opt(
        [], "Checkpoints with their learning rates (empty with the demo model = the demo's own)"
    )
    train_path: str = opt("", "Training examples (jsonl/csv, same fields as [data]); empty = demo train split")
    n_train: int = opt(0, "Training examples to score (0 = all)", min=0)
    n_test: int = opt(16, "Test examples to explain (0 = all)", min=0)
    layers: str = opt(
        "auto",
        "Parameters that count: adapter (the PEFT adapter's trainable ones, e.g. LoRA A/B), all, last (the last "
        "n_last_layers modules the forward runs), names, or auto (adapter when the checkpoints are PEFT adapter "
        "directories, else last)",
        choices=LAYER_MODES,
    )
    n_last_layers: int = opt(2, "How many final modules count when layers = last", min=1)
    layer_names: list[str] = opt([], "Module (or parameter) names whose parameters count when layers = names")
    method: str = opt(
        "auto",
        "Per-example gradients: closed_form (Linear layers only: one batched backward, trunk without graph), "
        "vmap (torch.func, any parameters), factored (Linear, Embedding and LayerNorm parameters of all layers, "
        "projected token by token with projection_in x projection_out: all layers at about the cost of one "
        "forward and backward), or auto (closed_form whenever it applies)",
        choices=GRADIENT_METHODS,
    )
    projection_dim: int = opt(
        0, "Seeded random projection: each parameter's gradient to at most this many numbers (0 = exact)", min=0
    )
    projection_in: int = opt(
        0,
        "method = factored: projected size of each layer's input side (0 = exact; an embedding's is its vocabulary)",
        min=0,
    )
    projection_out: int = opt(
        0,
        "method = factored: projected size of each layer's output side, and of biases and LayerNorm (0 = exact)",
        min=0,
    )
    projection_basis: str = opt(
        "random",
        "method = factored: the directions each projected side keeps: random (seeded), or pca (the directions in "
        "which the layer's inputs and output gradients vary most over pca_examples training examples, fitted at each "
        "checkpoint and kept with the cached gradients: agrees better with exact gradients at the same size; Linear "
        "and LoRA layers, others random)",
        choices=PROJECTION_BASES,
    )
    pca_examples: int = opt(
        256, "projection_basis = pca: training examples (the first ones) the directions are fitted to", min=1
    )
    optimizer_state: str = opt(
        "off",
        "adam: score each training gradient g by the Adam update it would make, Γ(g) = m̂/(√v̂+ε) with the moments, "
        "betas, eps and step count of optimizer.pt in each checkpoint's directory (as Hugging Face's Trainer saves "
        "it), one step on from the checkpoint; test gradients stay plain. closed_form or vmap only, not factored. "
        "off: plain gradients",
        choices=OPTIMIZER_STATES,
    )
    train_cache: bool = opt(
        False,
        "Keep the (projected) training gradients of each checkpoint in the user cache (bf16): a later run with other "
        "test examples computes only theirs; listed and cleared by gpuopt-tui cache",
    )
    agreement_train: int = opt(
        0,
        "Faithfulness check: score this many training examples (and at most 16 test examples) again with exact "
        "all-parameter gradients and report the Spearman correlation and top-10 overlap with this run's scores "
        "(0 = off); a bf16/fp16 run is also checked with its settings in fp32",
        min=0,
    )
    batch_size: int | Literal["auto"] = opt(
        "auto",
        'Examples per micro-batch, or "auto": on a GPU, as many as fit the free memory after a small probe '
        "(halved on out-of-memory)",
        min=1,
    )
    use_amp: bool = opt(True, "Mixed-precision forward on the GPU (fp32 on the CPU); scores accumulate in fp32")
    amp_dtype: str = opt("fp16", "Autocast dtype when use_amp is on", choices=("bf16", "fp16"))
    gradient_checkpointing: bool = opt(
        False, "Recompute activations in the backward pass to save memory (closed_form only; slower)"
    )
    cleanup_every: int = opt(
        50_000,
        "Free cached GPU memory every N examples (0 = never); the next micro-batch then allocates its memory "
        "afresh, which costs about as much as a small forward pass",
        min=0,
    )
    top_k: int = opt(10, "Proponents and opponents kept per test example", min=1)
    save_matrix_max: int = opt(50_000_000, "Save the full score matrix when it has at most this many entries", min=0)
    filter: str = opt(
        "none",
        "Batch filtering: score a training example against a test example only when they share the label "
        "(same_label) or an entity of a knowledge-graph triple (shared_entity)",
        choices=FILTER_CHOICES,
    )
    shard_size: int = opt(4096, "Training examples per resumable shard", min=1)

    def check(self, fail: Failure) -> None:
        if self.layers == "names" and not self.layer_names:
            fail("layer_names", "layers = names needs at least one module name")
        if self.method == "factored" and self.projection_dim:
            fail("projection_dim", "method = factored projects with projection_in and projection_out; set it to 0")
        if self.method == "factored" and self.optimizer_state == "adam":
            fail(
                "optimizer_state",
                'optimizer_state = "adam" transforms gradients elementwise, which method = factored cannot do: '
                "choose method = closed_form or vmap (projection_dim projects them), or optimizer_state = off",
            )
        if self.method != "factored" and (self.projection_in or self.projection_out):
            fail("projection_in", "projection_in and projection_out apply to method = factored only")
        projected = self.method == "factored" and (self.projection_in or self.projection_out)
        if self.projection_basis == "pca" and not projected:
            fail("projection_basis", "projection_basis = pca needs method = factored with projection_in or out")


@dataclass
class TracInProfile(ProfileBase):
    kind: ClassVar[str] = "tracin"
    title: ClassVar[str] = "TracIn training-data influence"
    run: ScaledRunSection = section(ScaledRunSection, "How and where to run")
    model: ModelSection = section(ModelSection, "The model whose checkpoints are scored")
    data: CompletionDataSection = section(CompletionDataSection, "Test examples to explain")
    tracin: TracInSection = section(TracInSection, "TracIn settings")
