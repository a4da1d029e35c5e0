"""The closed-form tier: peak GPU memory of one training step, component by component, without torch.

Where each term comes from:
- Model states (weights, gradients, AdamW/SGD/8-bit Adam state, fp32 master weights under DeepSpeed-style ZeRO
  mixed precision, DDP gradient buckets): exact byte counts per parameter from the optimizer and framework
  designs (AdamW: two fp32 moments; SGD: one momentum buffer; bitsandbytes 8-bit Adam: two 1-byte states plus an
  fp32 scale per 2048-element block; ZeRO stage k shards states/gradients/weights over the GPUs).
- Autocast keeps fp32 weights (they are the master copy) and caches a 16-bit copy of every trainable weight it
  casts, for the whole forward pass; the copies are also saved for backward (the gradient of a linear layer's
  input needs its weight), so without checkpointing they stay until each layer's backward. Frozen weights are
  cast afresh at every use; under LoRA their copies are saved the same way, the base model's linears included
  (with gradient checkpointing a layer saves none of them: each copy lives only while its layer runs).
- Activations: the saved-tensor inventories in `activations.py` (checked against autograd on real models);
  gradient checkpointing keeps each layer's fp32 input and recomputes one layer at a time in the backward pass.
  Encoder batches are taken to be padded (their attention mask becomes a bias in every layer); decoders to be
  unpadded (causal attention without a mask).
- Logits and loss (HF models compute their own loss from `labels=`, upcasting the logits to fp32): in the forward
  pass the 16-bit logits (held by the model's output), their fp32 copy and log_softmax's output; in the backward
  pass, once the loop dropped the output, log_softmax's output, nll_loss's gradient and log_softmax's gradient
  (12 B per token and vocabulary entry). Checked op by op against the live tensors of a CPU step (bf16 autocast).
- LoRA: each adapter keeps the 16-bit input of its A matrix (the adapted linear's input) and its rank-r output;
  the frozen base weights get no gradients, but their 16-bit copies are kept for the backward pass through them.
- The backward pass makes gradients as it goes (previous ones are freed by the loop, unless accumulating): the
  head's (a tied LM head's: the embedding matrix's) exist while the top layer runs backward with every activation
  still kept; all but the lowest layer's and the embeddings' exist while the lowest layer runs backward (with
  checkpointing: recomputed) and only its activations are left.
- Working buffers of one layer in backward (gradients of its intermediates): approximated as two of its widest
  tensors plus two fp32 residual-stream tensors.
- A frozen encoder's forward keeps nothing for backward, yet a layer's peak moment holds more than its two widest
  tensors. BERT-base under bf16, in the MLP's output: the embedding output and the layer input (kept by the
  model's forward and the layer loop), the attention block's output, the GELU output, the down projection after
  dropout, the residual sum and the LayerNorm output, 7.5 fp32 hidden-sized tensors per token (23 KB) where "two
  widest + two residual tensors" made 6 (18 KB). `activations.no_grad_moments` lists the moments per
  architecture; they match the live-tensor peak of the probe's own step on the CPU.
- The peak is the largest of the step's moments (a frozen encoder's forward, end of forward, start of backward,
  top and lowest layer's backward or recompute, end of backward, optimizer step), in the setup's loop: Lightning
  frees the previous step's gradients just before backward, so they are allocated during the forward pass; the
  HF Trainer and a plain loop free them after the step (or before the forward); accumulation keeps them.
- CUDA context: outside torch's allocator; 768 MiB unless measured (759-767 MiB after the steps of the
  benchmark's probes on an H200 with torch 2.11 and CUDA 13, lazily loaded kernels included).
- cuBLAS workspaces: 32 MiB per handle and stream on Hopper, one for the forward thread and one for autograd's.

Three terms are calibrated, not derived. Two on measured tables (H200, torch 2.11, bf16 autocast, AdamW, SDPA, a
plain loop that zeroes gradients before the forward pass; peak reserved memory of BERT-base and GPT-2 small):
- `Overheads.allocator`, 300 MiB of reserved-but-unallocated memory: the gap between the structural terms and
  the measured BERT-base full fine-tune rows; the same constant then fits that table's checkpointed row within 3%.
- `LM_RESERVED_SLACK`, reserved but unallocated memory around an LM loss, per token and vocabulary entry: 2 B when
  the head is frozen (the freed 16-bit logits block, which the backward pass's fp32 blocks cannot reuse), 4 B when
  it trains. GPT-2 small on an H100 (20 steps; reserved less allocated less `allocator`): 3.5 B full, 1.6 B LoRA;
  Qwen2-0.5B at sequence length 1024 (micro-batch 8 assumed): 4.8 B full, 2.1 B LoRA.
And `activations.NO_GRAD_HOLES`: the allocator's holes in a no-grad forward, which grow with the batch (BERT-base,
frozen encoder, batch 28653 on an H200: 108.1 GiB reserved where the tensors counted here come to 79.6 GiB).
Probes (the measured tier) replace all three.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpuopt_tui.core.planner import activations as act
from gpuopt_tui.core.planner.model_spec import ModelSpec
from gpuopt_tui.core.planner.step_sizes import StepSizes
from gpuopt_tui.core.planner.train_setup import OPTIMIZER_STATE, MiB, TrainSetup

# Reserved but unallocated bytes per token and vocabulary entry around an LM loss (calibrated, see the docstring):
# the freed 16-bit logits leave a hole the fp32 blocks of the backward pass cannot use (2 B, derived); when the
# head's weights train, their gradients split the freed logits blocks further (4 B, calibrated)
LM_RESERVED_SLACK = {"head trains": 4, "head frozen": 2}
LM_PHASES = ("end of forward", "start of backward")


@dataclass(frozen=True)
class Overheads:
    """Memory outside the model's tensors. Defaults suit a recent PyTorch on Hopper; probes measure them."""

    context: int = 768 * MiB  # CUDA context and loaded kernels, invisible to torch (759-767 MiB on an H200)
    workspaces: int = 2 * 32 * MiB  # cuBLAS workspaces: forward thread and autograd's thread
    allocator: int = 300 * MiB  # calibrated, see the module docstring


@dataclass(frozen=True)
class Component:
    key: str
    label: str
    bytes: int
    in_peak: bool  # part of the peak moment's sum (gradients, say, are freed at some moments)
    note: str


@dataclass(frozen=True)
class Estimate:
    """Peak memory of one training step on one GPU, by component."""

    spec: ModelSpec
    setup: TrainSetup
    components: tuple[Component, ...]
    phase: str  # the moment of the step where the peak is
    phases: dict[str, int]  # allocated bytes at each moment considered
    allocated: int  # peak of torch's allocated tensors
    reserved: int  # what torch.cuda.max_memory_reserved() would show
    total: int  # reserved + CUDA context: the process's footprint on the GPU
    params: int
    trainable_params: int
    tier: str = "closed-form estimate"

    def component(self, key: str) -> Component:
        for c in self.components:
            if c.key == key:
                return c
        raise KeyError(key)


def estimate(spec: ModelSpec, setup: TrainSetup, overheads: Overheads | None = None) -> Estimate:
    """The closed-form estimate of one training step's peak memory on one GPU."""
    setup.check()
    oh = overheads or Overheads()
    step = StepSizes(spec, setup)
    phases = _phases(step)
    unallocated = _unallocated(step, phases, oh)
    phase = max(phases, key=lambda k: phases[k] + unallocated[k])
    peak = _Peak(phase, _at_peak(step, phase), unallocated[phase], oh)
    components = (component(step, peak) for component in COMPONENTS)
    reserved = int(phases[phase]) + peak.unallocated + oh.workspaces
    return Estimate(
        spec=spec,
        setup=setup,
        components=tuple(c for c in components if c.bytes > 0),
        phase=phase,
        phases={k: int(v) for k, v in phases.items()},
        allocated=int(max(phases.values())),
        reserved=reserved,
        total=reserved + oh.context,
        params=step.total_params,
        trainable_params=step.p_t,
    )


@dataclass(frozen=True)
class _Peak:
    """The step's peak moment: what it holds besides the step's tensors."""

    phase: str  # the moment of the step where the peak is
    holds: set[str]  # the transient components allocated then
    unallocated: int  # reserved but unallocated bytes then
    overheads: Overheads  # memory outside the model's tensors


def _phases(s: StepSizes) -> dict[str, float]:
    """Allocated bytes at each moment of the step that can be its peak."""
    base, logits_fwd, logits_bwd = s.base, *s.logits
    phases = {
        "end of forward": base + s.grads_in_forward + s.cache + s.saved + logits_fwd,
        "start of backward": base + s.grads_in_backward + s.cache_in_backward + s.saved + logits_bwd,
        "optimizer step": base + s.grads + s.opt_temp,
        "end of backward": base + s.grads + (s.working if s.grad_upstream else 0),
    }
    in_backward = base + s.grads_in_backward
    if not s.grad_upstream:  # the encoder's forward runs before the head, keeps nothing and leaves holes
        phases["no-grad forward"] = base + s.grads_in_forward + s.working
    elif s.checkpointing:
        phases["recompute of the top layer"] = in_backward + s.head_grads + s.saved + s.layer + s.working
        # the lowest layer's input is the only checkpoint still kept
        phases["recompute of the lowest layer"] = in_backward + s.later_grads + s.layer_input + s.layer + s.working
    else:
        phases["top layer backward"] = in_backward + s.head_grads + s.cache_in_backward + s.saved + s.working
        phases["lowest layer backward"] = in_backward + s.later_grads + s.layer + s.working
    return phases


def _unallocated(s: StepSizes, phases: dict[str, float], overheads: Overheads) -> dict[str, int]:
    """Reserved but unallocated bytes at each moment: the allocator's overhead, the slack around an LM loss, or the
    holes a no-grad forward leaves."""
    allocator = overheads.allocator
    lm_slack = _lm_reserved_slack(s.spec, s.setup)
    return {
        k: max(allocator, s.holes) if k == "no-grad forward" else allocator + (lm_slack if k in LM_PHASES else 0)
        for k in phases
    }


def _at_peak(s: StepSizes, phase: str) -> set[str]:
    """Which of the step's transient components are allocated at `phase`."""
    grads = {"gradients"} if s.accumulating else set()
    forward_grads = {"gradients"} if s.setup.loop == "lightning" else grads
    cache = {"cast_cache"} if s.cache_kept else set()
    return {
        "no-grad forward": forward_grads | {"working"},
        "end of forward": {"cast_cache", "activations", "logits"} | forward_grads,
        "start of backward": grads | cache | {"activations", "logits"},
        "recompute of the top layer": grads | {"head_gradients", "activations", "recompute", "working"},
        "recompute of the lowest layer": grads | {"later_gradients", "lowest_input", "recompute", "working"},
        "top layer backward": grads | cache | {"head_gradients", "activations", "working"},
        "lowest layer backward": grads | {"later_gradients", "recompute", "working"},
        "end of backward": {"gradients"} | ({"working"} if s.grad_upstream else set()),
        "optimizer step": {"gradients", "optimizer_temp"},
    }[phase]


# The components, one function each, in the order the estimate lists them. Model states and fixed overheads are
# part of every moment; the transient terms count where the peak moment holds them.


def _weights(s: StepSizes, peak: _Peak) -> Component:
    master_note = " (fp32: autocast's master copy)" if s.autocast else ""
    note = f"{s.total_params:,} parameters x {s.state_bytes} B{master_note}{s.sharded(3)}"
    return Component("weights", "Weights", s.weights, True, note)


def _gradients(s: StepSizes, peak: _Peak) -> Component:
    note = f"{s.p_t:,} trainable x {s.state_bytes} B{s.sharded(2)}"
    return Component("gradients", "Gradients", s.grads, "gradients" in peak.holds, note)


def _head_gradients(s: StepSizes, peak: _Peak) -> Component:
    note = "made first in the backward pass (a tied LM head: the embedding matrix's gradient)"
    return Component("head_gradients", "Gradients of the head", s.head_grads, "head_gradients" in peak.holds, note)


def _later_gradients(s: StepSizes, peak: _Peak) -> Component:
    note = "all but the lowest layer's and the embeddings' gradients exist when the lowest layer runs backward"
    label = "Gradients of the layers above"
    return Component("later_gradients", label, s.later_grads, "later_gradients" in peak.holds, note)


def _optimizer(s: StepSizes, peak: _Peak) -> Component:
    optimizer = s.setup.optimizer
    note = f"{OPTIMIZER_STATE[optimizer]:g} B per trainable parameter{s.sharded(1)}"
    return Component("optimizer", f"Optimizer state ({optimizer})", s.opt_state, True, note)


def _master(s: StepSizes, peak: _Peak) -> Component:
    note = "ZeRO mixed precision keeps an fp32 copy per parameter"
    return Component("master", "fp32 master weights", s.master, True, note)


def _buckets(s: StepSizes, peak: _Peak) -> Component:
    return Component("buckets", "DDP gradient buckets", s.buckets, True, "one gradient-sized buffer for all-reduce")


def _cast_cache(s: StepSizes, peak: _Peak) -> Component:
    note = (
        "autocast's casts of trainable weights"
        + (" and of the frozen linears LoRA backpropagates through" if s.setup.trainable == "lora" else "")
        + (", kept for backward" if s.cache_kept else ", for the forward pass")
    )
    label = "16-bit weight copies (autocast)"
    return Component("cast_cache", label, s.cache, "cast_cache" in peak.holds, note)


def _activations(s: StepSizes, peak: _Peak) -> Component:
    label = "Activations" + (" (checkpointed)" if s.checkpointing and s.grad_upstream else "")
    note = _activation_note(s.spec, s.setup, s.grad_upstream)
    return Component("activations", label, int(s.saved), "activations" in peak.holds, note)


def _lowest_input(s: StepSizes, peak: _Peak) -> Component:
    nbytes = int(s.layer_input) if s.checkpointing and s.grad_upstream else 0
    note = "the only checkpoint left when the lowest layer is recomputed"
    return Component("lowest_input", "Lowest layer's input", nbytes, "lowest_input" in peak.holds, note)


def _recompute(s: StepSizes, peak: _Peak) -> Component:
    lowest = peak.phase.startswith(("lowest", "recompute of the lowest"))
    nbytes = int(s.layer) if s.grad_upstream and (s.checkpointing or lowest) else 0
    if s.checkpointing:
        label, note = "One layer recomputed", "gradient checkpointing rebuilds one layer's activations at a time"
    else:
        label, note = (
            "One layer's activations",
            "what the lowest layer keeps, the last activations alive in the backward pass",
        )
    return Component("recompute", label, nbytes, "recompute" in peak.holds, note)


def _logits(s: StepSizes, peak: _Peak) -> Component:
    logits_fwd, logits_bwd = s.logits
    nbytes = int(logits_bwd if peak.phase == "start of backward" else logits_fwd)
    label, note = "Logits and loss (fp32 copies)", _logits_note(s.spec, s.a_bytes)
    return Component("logits", label, nbytes, "logits" in peak.holds, note)


def _working(s: StepSizes, peak: _Peak) -> Component:
    if s.grad_upstream:
        label = "Layer working buffers"
        note = "gradients or live intermediates of one layer (two widest tensors + two residual tensors)"
    else:
        label = "Forward pass without gradients"
        note = "one layer at its peak moment, the embedding output and the layer input (nothing kept)"
    return Component("working", label, int(s.working), "working" in peak.holds, note)


def _optimizer_temp(s: StepSizes, peak: _Peak) -> Component:
    if s.setup.fused_adamw:
        note = "none: the loop's AdamW is torch's fused one (the HF Trainer's default), which updates in place"
    else:
        note = "foreach AdamW builds one fp32 tensor per parameter while stepping"
    label = "Optimizer step temporaries"
    return Component("optimizer_temp", label, s.opt_temp, "optimizer_temp" in peak.holds, note)


def _batch(s: StepSizes, peak: _Peak) -> Component:
    return Component("batch", "Batch data", s.batch, True, "token ids, masks and labels (int64)")


def _workspaces(s: StepSizes, peak: _Peak) -> Component:
    note = "per handle and stream, forward and backward"
    return Component("workspaces", "cuBLAS workspaces", peak.overheads.workspaces, True, note)


def _allocator(s: StepSizes, peak: _Peak) -> Component:
    holes = "" if s.grad_upstream else f"; the forward leaves ~{act.no_grad_holes(s.spec):g} fp32 hidden holes/token"
    note = "reserved but not allocated (calibrated)" + holes
    return Component("allocator", "Allocator overhead", peak.unallocated, True, note)


def _context(s: StepSizes, peak: _Peak) -> Component:
    return Component(
        "context", "CUDA context", peak.overheads.context, True, "driver context and kernels, outside torch"
    )


COMPONENTS: tuple[Callable[[StepSizes, _Peak], Component], ...] = (
    _weights,
    _gradients,
    _head_gradients,
    _later_gradients,
    _optimizer,
    _master,
    _buckets,
    _cast_cache,
    _activations,
    _lowest_input,
    _recompute,
    _logits,
    _working,
    _optimizer_temp,
    _batch,
    _workspaces,
    _allocator,
    _context,
)


def _lm_reserved_slack(spec: ModelSpec, setup: TrainSetup) -> int:
    if spec.task not in ("causal_lm", "masked_lm"):
        return 0
    key = "head trains" if setup.trainable == "all" else "head frozen"
    return LM_RESERVED_SLACK[key] * spec.vocab * setup.tokens


def _activation_note(spec: ModelSpec, setup: TrainSetup, grad_upstream: bool) -> str:
    tokens = f"{setup.sequences} sequences x {setup.seq_len} tokens"
    if setup.sequences_per_example > 1:
        tokens += f" ({setup.micro_batch} x {setup.sequences_per_example} per anchor)"
    if not grad_upstream:
        return f"frozen encoder keeps nothing for backward; {tokens}"
    if setup.gradient_checkpointing:
        return f"each of {spec.layers} layers keeps its input; {tokens}"
    return f"{spec.layers} layers x saved tensors per token (SDPA); {tokens}"


def _logits_note(spec: ModelSpec, a_bytes: int) -> str:
    if spec.task in ("causal_lm", "masked_lm"):
        return f"{spec.vocab:,}-way logits: {a_bytes} B + fp32 copies per token and vocabulary entry"
    return "small: one row per sequence"
