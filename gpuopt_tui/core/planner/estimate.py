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

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.planner import activations as act
from gpuopt_tui.core.planner.model_spec import ModelSpec
from gpuopt_tui.core.planner.train_setup import OPTIMIZER_STATE, OPTIMIZER_TEMP, MiB, TrainSetup

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


def _trainable(spec: ModelSpec, setup: TrainSetup) -> tuple[int, int, Callable[[str], bool]]:
    """(parameters in the model incl. adapters, trainable parameters, which weights train)."""
    if setup.trainable == "all":
        return spec.params, spec.params, lambda name: True
    head_trains = setup.trainable == "frozen_encoder" or spec.task == "classification"
    if setup.trainable == "frozen_encoder":
        if spec.head_params == 0:
            raise UserError(
                f"{spec.source}: with a frozen encoder nothing trains: this {spec.model_type} {spec.task} model's "
                "head has no weights of its own (it is tied to the embeddings or absent); use LoRA or train all"
            )
        return spec.params, spec.head_params, lambda name: name == "head"
    targets = {lin.name for lin in spec.lora_linears(setup.lora_targets)}
    lora = spec.lora_params(setup.lora_rank, setup.lora_targets)
    head = spec.head_params if head_trains else 0  # a classifier head trains along with the adapters
    return spec.params + lora, lora + head, lambda name: name in targets or (name == "head" and head_trains)


def _cast_cache_weights(spec: ModelSpec, setup: TrainSetup) -> int:
    """Weights whose 16-bit copies autocast makes once and that stay for the forward pass: the trainable ones (its
    cache), and under LoRA the frozen linears too: not cached, but each copy is saved for backward, which needs
    the weight for the gradient of the layer's input. With gradient checkpointing the layers save nothing, so a
    frozen linear's copy lives only while its layer runs (the layer working buffers cover it)."""
    if setup.trainable == "all":
        return spec.layers * spec.layer_linear_params + spec.head_linear_weights
    if setup.trainable == "lora":
        saved = (
            0 if setup.gradient_checkpointing else spec.layers * sum(lin.d_in * lin.d_out for lin in spec.layer_linears)
        )
        return spec.lora_params(setup.lora_rank, setup.lora_targets) + saved + spec.head_linear_weights
    return spec.head_linear_weights


def estimate(spec: ModelSpec, setup: TrainSetup, overheads: Overheads | None = None) -> Estimate:
    """The closed-form estimate of one training step's peak memory on one GPU."""
    setup.check()
    oh = overheads or Overheads()
    n = setup.n_gpus
    zero = setup.zero_stage
    deepspeed_mixed = zero > 0 and setup.mixed  # 16-bit weights and gradients, fp32 master in the optimizer
    autocast = setup.mixed and not deepspeed_mixed
    a_bytes = 2 if setup.mixed else 4
    f32_bytes = 2 if deepspeed_mixed else 4
    total_params, p_t, trains = _trainable(spec, setup)

    def shard(nbytes: float, stage: int) -> int:
        return int(nbytes / n) if zero >= stage else int(nbytes)

    state_bytes = 2 if deepspeed_mixed else 4  # of weights and gradients
    weights = shard(total_params * state_bytes, 3)
    grads = shard(p_t * state_bytes, 2)
    opt_state = shard(p_t * OPTIMIZER_STATE[setup.optimizer], 1)
    master = shard(p_t * 4, 1) if deepspeed_mixed else 0
    buckets = p_t * 4 if n > 1 and zero == 0 else 0
    opt_temp = shard(p_t * OPTIMIZER_TEMP[setup.optimizer], 1)
    cache = 2 * _cast_cache_weights(spec, setup) if autocast else 0

    tokens = setup.tokens
    grad_upstream = setup.trainable in ("all", "lora")

    def per_token(entries: tuple[act.Saved, ...]) -> float:
        return act.saved_bytes_per_token(entries, spec, a_bytes, autocast, trains, f32_bytes, setup.seq_len)

    layer = per_token(act.layer_inventory(spec, padded=not spec.decoder)) * tokens
    if setup.trainable == "lora":
        layer += _lora_rank_bytes(spec, setup, a_bytes) * tokens
    if grad_upstream:
        working = (2 * act.largest_tensor_bytes_per_token(spec, a_bytes) + 2 * f32_bytes * spec.hidden) * tokens
    else:
        working = act.no_grad_bytes_per_token(spec, a_bytes, autocast, f32_bytes, setup.seq_len) * tokens
    head_entries = tuple(
        e
        for e in act.head_inventory(spec)
        if e.weight is not None or grad_upstream  # the final norm keeps its input only for gradients upstream
    )
    edge = per_token(head_entries) * tokens
    if setup.trainable == "all":
        edge += per_token(act.embedding_inventory(spec)) * tokens
    if not grad_upstream:
        saved = 0.0
    elif setup.gradient_checkpointing:
        saved = spec.layers * f32_bytes * spec.hidden * tokens  # each layer's input
    else:
        saved = spec.layers * layer
    saved += edge
    logits_fwd, logits_bwd = _logits(spec, setup, a_bytes)
    batch = _batch_bytes(spec, setup)

    base = weights + opt_state + master + buckets + batch
    accumulating = setup.accumulate > 1
    grads_in_backward = grads if accumulating else 0
    grads_in_forward = grads if accumulating or setup.loop == "lightning" else 0
    # the backward pass makes gradients as it goes: the head's first, the lowest layer's last
    head_grads = 0 if accumulating else shard(_head_grad_params(spec, setup) * state_bytes, 2)
    later_grads = 0 if accumulating else max(0, grads - shard(_layer_grad_params(spec, setup) * state_bytes, 2))
    # saved for backward, the 16-bit weight copies outlive autocast's cache (checkpointing saves none of them)
    cache_kept = grad_upstream and not setup.gradient_checkpointing
    cache_in_backward = cache if cache_kept else 0
    phases = {
        "end of forward": base + grads_in_forward + cache + saved + logits_fwd,
        "start of backward": base + grads_in_backward + cache_in_backward + saved + logits_bwd,
        "optimizer step": base + grads + opt_temp,
        "end of backward": base + grads + (working if grad_upstream else 0),
    }
    holes = 0
    if not grad_upstream:  # the encoder's forward runs before the head, keeps nothing and leaves holes
        phases["no-grad forward"] = base + grads_in_forward + working
        holes = int(act.no_grad_holes(spec) * f32_bytes * spec.hidden * tokens)
    elif setup.gradient_checkpointing:
        phases["recompute of the top layer"] = base + grads_in_backward + head_grads + saved + layer + working
        lowest = f32_bytes * spec.hidden * tokens  # the lowest layer's input, the only one still kept
        phases["recompute of the lowest layer"] = base + grads_in_backward + later_grads + lowest + layer + working
    else:
        top = base + grads_in_backward + head_grads + cache_in_backward + saved + working
        phases["top layer backward"] = top
        phases["lowest layer backward"] = base + grads_in_backward + later_grads + layer + working
    lm_slack = _lm_reserved_slack(spec, setup)
    unallocated = {
        k: max(oh.allocator, holes) if k == "no-grad forward" else oh.allocator + (lm_slack if k in LM_PHASES else 0)
        for k in phases
    }
    phase = max(phases, key=lambda k: phases[k] + unallocated[k])
    allocated = int(max(phases.values()))
    reserved = int(phases[phase]) + unallocated[phase] + oh.workspaces

    at_peak = _at_peak(phase, grad_upstream, accumulating, setup.loop == "lightning", cache_kept)
    lowest = phase.startswith(("lowest", "recompute of the lowest"))
    pct = f"{100 / n:.0f}% of " if n > 1 else ""
    master_note = " (fp32: autocast's master copy)" if autocast else ""
    components = (
        Component(
            "weights",
            "Weights",
            weights,
            True,
            f"{total_params:,} parameters x {state_bytes} B{master_note}{_sharded(zero, 3, pct)}",
        ),
        Component(
            "gradients",
            "Gradients",
            grads,
            "gradients" in at_peak,
            f"{p_t:,} trainable x {state_bytes} B{_sharded(zero, 2, pct)}",
        ),
        Component(
            "head_gradients",
            "Gradients of the head",
            head_grads,
            "head_gradients" in at_peak,
            "made first in the backward pass (a tied LM head: the embedding matrix's gradient)",
        ),
        Component(
            "later_gradients",
            "Gradients of the layers above",
            later_grads,
            "later_gradients" in at_peak,
            "all but the lowest layer's and the embeddings' gradients exist when the lowest layer runs backward",
        ),
        Component(
            "optimizer",
            f"Optimizer state ({setup.optimizer})",
            opt_state,
            True,
            f"{OPTIMIZER_STATE[setup.optimizer]:g} B per trainable parameter{_sharded(zero, 1, pct)}",
        ),
        Component(
            "master", "fp32 master weights", master, True, "ZeRO mixed precision keeps an fp32 copy per parameter"
        ),
        Component("buckets", "DDP gradient buckets", buckets, True, "one gradient-sized buffer for all-reduce"),
        Component(
            "cast_cache",
            "16-bit weight copies (autocast)",
            cache,
            "cast_cache" in at_peak,
            "autocast's casts of trainable weights"
            + (" and of the frozen linears LoRA backpropagates through" if setup.trainable == "lora" else "")
            + (", kept for backward" if cache_kept else ", for the forward pass"),
        ),
        Component(
            "activations",
            "Activations" + (" (checkpointed)" if setup.gradient_checkpointing and grad_upstream else ""),
            int(saved),
            "activations" in at_peak,
            _activation_note(spec, setup, grad_upstream),
        ),
        Component(
            "lowest_input",
            "Lowest layer's input",
            int(f32_bytes * spec.hidden * tokens) if setup.gradient_checkpointing and grad_upstream else 0,
            "lowest_input" in at_peak,
            "the only checkpoint left when the lowest layer is recomputed",
        ),
        Component(
            "recompute",
            "One layer recomputed" if setup.gradient_checkpointing else "One layer's activations",
            int(layer) if grad_upstream and (setup.gradient_checkpointing or lowest) else 0,
            "recompute" in at_peak,
            "gradient checkpointing rebuilds one layer's activations at a time"
            if setup.gradient_checkpointing
            else "what the lowest layer keeps, the last activations alive in the backward pass",
        ),
        Component(
            "logits",
            "Logits and loss (fp32 copies)",
            int(logits_bwd if phase == "start of backward" else logits_fwd),
            "logits" in at_peak,
            _logits_note(spec, a_bytes),
        ),
        Component(
            "working",
            "Layer working buffers" if grad_upstream else "Forward pass without gradients",
            int(working),
            "working" in at_peak,
            "gradients or live intermediates of one layer (two widest tensors + two residual tensors)"
            if grad_upstream
            else "one layer at its peak moment, the embedding output and the layer input (nothing kept)",
        ),
        Component(
            "optimizer_temp",
            "Optimizer step temporaries",
            opt_temp,
            "optimizer_temp" in at_peak,
            "foreach AdamW builds one fp32 tensor per parameter while stepping",
        ),
        Component("batch", "Batch data", batch, True, "token ids, masks and labels (int64)"),
        Component(
            "workspaces", "cuBLAS workspaces", oh.workspaces, True, "per handle and stream, forward and backward"
        ),
        Component(
            "allocator",
            "Allocator overhead",
            unallocated[phase],
            True,
            "reserved but not allocated (calibrated)"
            + ("" if grad_upstream else f"; the forward leaves ~{act.no_grad_holes(spec):g} fp32 hidden holes/token"),
        ),
        Component("context", "CUDA context", oh.context, True, "driver context and kernels, outside torch"),
    )
    return Estimate(
        spec=spec,
        setup=setup,
        components=tuple(c for c in components if c.bytes > 0),
        phase=phase,
        phases={k: int(v) for k, v in phases.items()},
        allocated=allocated,
        reserved=reserved,
        total=reserved + oh.context,
        params=total_params,
        trainable_params=p_t,
    )


def _at_peak(phase: str, grad_upstream: bool, accumulating: bool, lightning: bool, cache_kept: bool) -> set[str]:
    """Which of the step's transient components are allocated at `phase`."""
    grads = {"gradients"} if accumulating else set()
    forward_grads = {"gradients"} if lightning else grads
    cache = {"cast_cache"} if cache_kept else set()
    return {
        "no-grad forward": forward_grads | {"working"},
        "end of forward": {"cast_cache", "activations", "logits"} | forward_grads,
        "start of backward": grads | cache | {"activations", "logits"},
        "recompute of the top layer": grads | {"head_gradients", "activations", "recompute", "working"},
        "recompute of the lowest layer": grads | {"later_gradients", "lowest_input", "recompute", "working"},
        "top layer backward": grads | cache | {"head_gradients", "activations", "working"},
        "lowest layer backward": grads | {"later_gradients", "recompute", "working"},
        "end of backward": {"gradients"} | ({"working"} if grad_upstream else set()),
        "optimizer step": {"gradients", "optimizer_temp"},
    }[phase]


def _sharded(zero: int, stage: int, pct: str) -> str:
    return f", {pct}(ZeRO-{zero})" if pct and zero >= stage else ""


def _logits(spec: ModelSpec, setup: TrainSetup, a_bytes: int) -> tuple[float, float]:
    """Logits/loss bytes at the end of forward and at the start of backward."""
    if spec.task in ("causal_lm", "masked_lm"):
        v, t = spec.vocab, setup.tokens
        upcast = 4 * v if a_bytes != 4 else 0  # the loss's .float() copy (freed after log_softmax)
        # forward, inside the loss: the logits (held by the model's output), their fp32 copy, log_softmax's output;
        # backward, once the loop dropped the output: log_softmax's output, nll_loss's gradient and log_softmax's
        return (a_bytes * v + upcast + 4 * v) * t, 12.0 * v * t
    if spec.task == "embedding":
        # in-batch similarities of anchors against every sequence: scores, softmax and gradient in fp32
        s = setup.sequences
        return 8.0 * s * setup.micro_batch, 12.0 * s * setup.micro_batch
    return 0.0, 0.0


def _lm_reserved_slack(spec: ModelSpec, setup: TrainSetup) -> int:
    if spec.task not in ("causal_lm", "masked_lm"):
        return 0
    key = "head trains" if setup.trainable == "all" else "head frozen"
    return LM_RESERVED_SLACK[key] * spec.vocab * setup.tokens


def _head_grad_params(spec: ModelSpec, setup: TrainSetup) -> int:
    """Trainable parameters whose gradients the backward pass makes before the layers': the head, the final norm
    and, for a tied LM head, the embedding matrix."""
    if setup.trainable == "all":
        tied = spec.vocab * spec.hidden if spec.tied_embeddings and spec.task in ("causal_lm", "masked_lm") else 0
        return spec.head_params + spec.final_params + tied
    return spec.head_params if spec.task == "classification" else 0


def _layer_grad_params(spec: ModelSpec, setup: TrainSetup) -> int:
    """Trainable parameters whose gradients do not exist yet while the lowest layer runs backward."""
    if setup.trainable == "all":
        tied = spec.vocab * spec.hidden if spec.tied_embeddings and spec.task in ("causal_lm", "masked_lm") else 0
        return spec.layer_params + spec.embedding_params - tied
    if setup.trainable == "lora":
        return spec.lora_params(setup.lora_rank, setup.lora_targets) // spec.layers
    return 0


def _lora_rank_bytes(spec: ModelSpec, setup: TrainSetup, a_bytes: int) -> int:
    """Per token and layer: the rank-r intermediate each adapter keeps for its B matrix's gradient."""
    return a_bytes * setup.lora_rank * len(spec.lora_linears(setup.lora_targets))


def _batch_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    per_token = 8 * (3 if spec.model_type in ("bert", "roberta") else 2)  # ids, mask (+ token types)
    if spec.task in ("causal_lm", "masked_lm"):
        per_token += 8  # labels
    nbytes = per_token * setup.tokens + 8 * setup.sequences
    if not spec.decoder:
        nbytes += setup.sequences * setup.seq_len**2  # the expanded boolean attention mask
    return nbytes


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
