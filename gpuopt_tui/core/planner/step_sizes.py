"""The sizes of one training step's terms, each computed once: model states, gradients as the backward pass makes
them, saved activations, logits and loss. `estimate.py` composes them into the step's moments and components; its
docstring says where each term comes from."""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.planner import activations as act
from gpuopt_tui.core.planner.model_spec import ModelSpec
from gpuopt_tui.core.planner.train_setup import OPTIMIZER_STATE, TrainSetup


class StepSizes:
    """What one training step holds, term by term: the sizes its moments and its components are made of."""

    def __init__(self, spec: ModelSpec, setup: TrainSetup) -> None:
        self.spec, self.setup = spec, setup
        self.n = setup.n_gpus
        self.zero = setup.zero_stage
        self.deepspeed_mixed = self.zero > 0 and setup.mixed  # 16-bit weights and grads, fp32 master in the optimizer
        self.autocast = setup.mixed and not self.deepspeed_mixed
        self.a_bytes = 2 if setup.mixed else 4
        self.f32_bytes = 2 if self.deepspeed_mixed else 4
        self.state_bytes = 2 if self.deepspeed_mixed else 4  # of weights and gradients
        self.total_params, self.p_t, self.trains = _trainable(spec, setup)
        self.tokens = setup.tokens
        self.grad_upstream = setup.trainable in ("all", "lora")
        self.checkpointing = setup.gradient_checkpointing
        self.accumulating = setup.accumulate > 1
        # saved for backward, the 16-bit weight copies outlive autocast's cache (checkpointing saves none of them)
        self.cache_kept = self.grad_upstream and not self.checkpointing
        self.layer_input = self.f32_bytes * spec.hidden * self.tokens  # a layer's fp32 input (its checkpoint)

    def shard(self, nbytes: float, stage: int) -> int:
        return int(nbytes / self.n) if self.zero >= stage else int(nbytes)

    def sharded(self, stage: int) -> str:
        """The note's suffix for a term ZeRO shards from `stage` on."""
        return f", {100 / self.n:.0f}% of (ZeRO-{self.zero})" if self.n > 1 and self.zero >= stage else ""

    def per_token(self, entries: tuple[act.Saved, ...]) -> float:
        return act.saved_bytes_per_token(
            entries, self.spec, self.a_bytes, self.autocast, self.trains, self.f32_bytes, self.setup.seq_len
        )

    # model states
    @cached_property
    def weights(self) -> int:
        return self.shard(self.total_params * self.state_bytes, 3)

    @cached_property
    def grads(self) -> int:
        return self.shard(self.p_t * self.state_bytes, 2)

    @cached_property
    def opt_state(self) -> int:
        return self.shard(self.p_t * OPTIMIZER_STATE[self.setup.optimizer], 1)

    @cached_property
    def master(self) -> int:
        return self.shard(self.p_t * 4, 1) if self.deepspeed_mixed else 0

    @cached_property
    def buckets(self) -> int:
        return self.p_t * 4 if self.n > 1 and self.zero == 0 else 0

    @cached_property
    def opt_temp(self) -> int:
        return self.shard(self.p_t * self.setup.optimizer_temp, 1)

    @cached_property
    def cache(self) -> int:
        return 2 * _cast_cache_weights(self.spec, self.setup) if self.autocast else 0

    @cached_property
    def batch(self) -> int:
        return _batch_bytes(self.spec, self.setup)

    @cached_property
    def base(self) -> int:
        """What every moment of the step holds."""
        return self.weights + self.opt_state + self.master + self.buckets + self.batch

    # gradients, as the backward pass makes them: the head's first, the lowest layer's last
    @cached_property
    def grads_in_forward(self) -> int:
        return self.grads if self.accumulating or self.setup.loop == "lightning" else 0

    @cached_property
    def grads_in_backward(self) -> int:
        return self.grads if self.accumulating else 0

    @cached_property
    def head_grads(self) -> int:
        return 0 if self.accumulating else self.shard(_head_grad_params(self.spec, self.setup) * self.state_bytes, 2)

    @cached_property
    def later_grads(self) -> int:
        layer_grads = self.shard(_layer_grad_params(self.spec, self.setup) * self.state_bytes, 2)
        return 0 if self.accumulating else max(0, self.grads - layer_grads)

    @cached_property
    def cache_in_backward(self) -> int:
        return self.cache if self.cache_kept else 0

    # activations
    @cached_property
    def layer(self) -> float:
        """What one layer saves for backward."""
        spec, setup = self.spec, self.setup
        layer = self.per_token(act.layer_inventory(spec, padded=not spec.decoder)) * self.tokens
        if setup.trainable == "lora":
            layer += _lora_rank_bytes(spec, setup, self.a_bytes) * self.tokens
        return layer

    @cached_property
    def working(self) -> float:
        spec = self.spec
        if self.grad_upstream:
            widest = act.largest_tensor_bytes_per_token(spec, self.a_bytes)
            return (2 * widest + 2 * self.f32_bytes * spec.hidden) * self.tokens
        no_grad = act.no_grad_bytes_per_token(spec, self.a_bytes, self.autocast, self.f32_bytes, self.setup.seq_len)
        return no_grad * self.tokens

    @cached_property
    def saved(self) -> float:
        """Activations saved for backward: every layer's (or every layer's input) and the head's and embeddings'."""
        if not self.grad_upstream:
            saved = 0.0
        elif self.checkpointing:
            saved = self.spec.layers * self.f32_bytes * self.spec.hidden * self.tokens  # each layer's input
        else:
            saved = self.spec.layers * self.layer
        return saved + self.edge

    @cached_property
    def edge(self) -> float:
        """What the head (and, when they train, the embeddings) save for backward."""
        head_entries = tuple(
            e
            for e in act.head_inventory(self.spec)
            if e.weight is not None or self.grad_upstream  # the final norm keeps its input only for gradients upstream
        )
        edge = self.per_token(head_entries) * self.tokens
        if self.setup.trainable == "all":
            edge += self.per_token(act.embedding_inventory(self.spec)) * self.tokens
        return edge

    @cached_property
    def logits(self) -> tuple[float, float]:
        """Logits and loss at the end of forward and at the start of backward."""
        return _logits_bytes(self.spec, self.setup, self.a_bytes)

    @cached_property
    def holes(self) -> int:
        """The allocator's holes a no-grad forward leaves."""
        return int(act.no_grad_holes(self.spec) * self.f32_bytes * self.spec.hidden * self.tokens)


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


def _logits_bytes(spec: ModelSpec, setup: TrainSetup, a_bytes: int) -> tuple[float, float]:
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
