"""Tensors a transformer keeps for its backward pass, per token, read off the transformers forward code.

Each layer is an inventory of saved tensors with their width (hidden h, MLP width f, query width q, key/value
width kv, heads) and their dtype class:
- "act": the compute dtype (2 bytes under bf16/fp16 autocast, 4 in fp32);
- "f32": fp32 in every mode: the residual stream (fp32 weights make LayerNorm/RMSNorm outputs and residual sums
  fp32 under autocast), LayerNorm inputs, and ops autocast runs in fp32 (pow in GPT-2's gelu_new);
- "mask": CUDA dropout masks, one byte per element;
- "cast": a 16-bit copy autocast makes of an fp32 input (none in fp32).
A linear layer keeps its input only when its weight gets a gradient (full fine-tune, or a LoRA adapter on it).
Under autocast each linear casts an fp32 input to a fresh 16-bit copy, so three projections of one fp32 input
keep three copies; in fp32 they share the one input tensor. Tensors with the same `source` are one tensor.
Attention is SDPA (flash or memory-efficient): it keeps q, k, v, its output and the log-sum-exp, no s x s term.

These inventories were checked against the bytes autograd actually saves (saved-tensor hooks) for fp32 models
on the CPU; the dtype rules for autocast follow PyTorch's CUDA autocast op lists.

A forward pass that keeps nothing for backward (a frozen encoder) is described by its peak moments instead: what
each moment of one layer holds, read off the same code (a tensor lives while a Python local or argument refers to
it), checked against the peak of live tensors of the probe's step on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpuopt_tui.core.planner.model_spec import GELU_NEW, ModelSpec

DTYPE_BYTES_F32 = 4
MASK_BYTES = 1


@dataclass(frozen=True)
class Saved:
    """One tensor kept for backward (or alive at a moment of a no-grad forward), per token: `mult` x width
    elements."""

    what: str
    width: str  # "h", "f", "q", "kv", "heads", "seq" (sequence length) or "token" (one element per token)
    dtype: str  # "act", "f32", "mask" or "cast"
    mult: int = 1
    weight: str | None = None  # kept only when this weight trains (a linear layer's name, or "norm")
    linear: bool = False  # the input of a linear layer: autocast casts an fp32 input afresh for each one
    source: str | None = None  # tensors with the same source are one tensor


def widths(spec: ModelSpec, seq_len: int = 0) -> dict[str, int]:
    return {
        "seq": seq_len,
        "h": spec.hidden,
        "f": spec.mlp,
        "q": spec.heads * spec.head_dim,
        "kv": spec.kv_heads * spec.head_dim,
        "heads": spec.heads,
        "token": 1,
    }


def _layer_norm(what: str) -> list[Saved]:
    return [Saved(f"{what} input", "h", "f32"), Saved(f"{what} mean and rstd", "token", "f32", mult=2)]


def _masks(spec: ModelSpec, count: int) -> list[Saved]:
    return [Saved("dropout mask", "h", "mask")] * count if spec.hidden_dropout > 0 else []


def _sdpa(kv_from_one_tensor: bool) -> list[Saved]:
    qkv = (
        [Saved("q, k, v (one tensor)", "q", "act", mult=3)]
        if kv_from_one_tensor
        else [Saved("q", "q", "act"), Saved("k", "kv", "act"), Saved("v", "kv", "act")]
    )
    return [*qkv, Saved("attention output", "q", "act", source="ctx"), Saved("log-sum-exp", "heads", "f32")]


def _activation(spec: ModelSpec, up_source: str) -> tuple[list[Saved], str]:
    """What the MLP activation keeps, and the dtype class of its output."""
    if spec.activation in GELU_NEW:
        # 0.5*x*(1+tanh(c*(x+0.044715*x**3))) in Python: autocast runs pow in fp32, so everything after is fp32
        return [
            Saved("pow input", "f", "f32"),
            Saved("tanh output", "f", "f32"),
            Saved("1 + tanh", "f", "f32"),
            Saved("0.5 * x", "f", "act"),
        ], "f32"
    return [Saved("activation input", "f", "act", source=up_source)], "act"


def layer_inventory(spec: ModelSpec, padded: bool = False) -> tuple[Saved, ...]:
    """The tensors one layer keeps for backward. `padded`: an encoder batch with padding, whose boolean mask
    SDPA turns into an additive bias (a row of the sequence length per token) in every layer, kept for backward."""
    t = spec.model_type
    if t in ("bert", "roberta", "distilbert"):
        mask = [Saved("attention mask as a bias", "seq", "act")] if padded else []
        names = (
            ("q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2")
            if t == "distilbert"
            else ("query", "key", "value", "dense", "dense", "dense")
        )
        act, act_dtype = _activation(spec, "up")
        return (
            *(Saved(f"{n} input", "h", "f32", weight=n, linear=True, source="x") for n in names[:3]),
            *_sdpa(kv_from_one_tensor=False),
            *mask,
            Saved(f"{names[3]} input", "q", "act", weight=names[3], linear=True, source="ctx"),
            *_masks(spec, 0 if t == "distilbert" else 1),
            *_layer_norm("LayerNorm"),
            Saved(f"{names[4]} input", "h", "f32", weight=names[4], linear=True, source="x1"),
            *act,
            Saved(f"{names[5]} input", "f", act_dtype, weight=names[5], linear=True, source="act out"),
            *_masks(spec, 1),
            *_layer_norm("LayerNorm"),
        )
    if t == "gpt2":
        act, act_dtype = _activation(spec, "up")
        return (
            *_layer_norm("ln_1"),
            Saved("c_attn input", "h", "f32", weight="c_attn", linear=True, source="n1"),
            *_sdpa(kv_from_one_tensor=True),
            Saved("c_proj input", "q", "act", weight="c_proj", linear=True, source="ctx"),
            *_masks(spec, 1),
            *_layer_norm("ln_2"),
            Saved("c_fc input", "h", "f32", weight="c_fc", linear=True, source="n2"),
            *act,
            Saved("c_proj input", "f", act_dtype, weight="c_proj", linear=True, source="act out"),
            *_masks(spec, 1),
        )
    # Llama-style: RMSNorm in Python keeps its fp32 input and the normalised fp32 tensor; RoPE keeps only cos/sin
    # (shared); under autocast SDPA casts the fp32 rotated q and k back to 16 bits
    rms = _rms_norm("RMSNorm")
    return (
        *rms,
        *(Saved(f"{n} input", "h", "f32", weight=n, linear=True, source="n1") for n in ("q_proj", "k_proj", "v_proj")),
        *_sdpa(kv_from_one_tensor=False),
        Saved("o_proj input", "q", "act", weight="o_proj", linear=True, source="ctx"),
        *rms,
        *(Saved(f"{n} input", "h", "f32", weight=n, linear=True, source="n2") for n in ("gate_proj", "up_proj")),
        Saved("gate output (SiLU input)", "f", "act"),
        Saved("SiLU output", "f", "act"),
        Saved("up output", "f", "act"),
        Saved("down_proj input", "f", "act", weight="down_proj", linear=True, source="product"),
    )


def _rms_norm(what: str) -> list[Saved]:
    return [
        Saved(f"{what} input", "h", "f32"),
        Saved(f"{what} rsqrt", "token", "f32"),
        Saved(f"{what} normalised", "h", "f32", weight="norm"),  # kept by `weight * x` only for the weight
    ]


def embedding_inventory(spec: ModelSpec) -> tuple[Saved, ...]:
    """What the embedding block keeps; only when the embeddings train (nothing upstream needs a gradient)."""
    if spec.model_type in ("bert", "roberta", "distilbert"):
        return (*_layer_norm("embeddings LayerNorm"), *_masks(spec, 1))
    if spec.model_type == "gpt2":
        return tuple(_masks(spec, 1))
    return ()


def head_inventory(spec: ModelSpec) -> tuple[Saved, ...]:
    """What the final norm and the head keep per token (a head on pooled tokens counts as nothing per token)."""
    if spec.model_type in ("bert", "roberta", "distilbert"):
        if spec.task != "masked_lm":
            return ()
        return (
            Saved("transform input", "h", "f32", weight="head", linear=True, source="last"),
            Saved("transform activation input", "h", "act"),
            *_layer_norm("transform LayerNorm"),
            Saved("decoder input", "h", "f32", weight="head", linear=True, source="normed"),
        )
    norm = _layer_norm("ln_f") if spec.model_type == "gpt2" else _rms_norm("norm")
    if spec.task == "embedding":
        return tuple(norm)
    return (*norm, Saved("head input", "h", "f32", weight="head", linear=True, source="final"))


def _dtype_bytes(dtype: str, act_bytes: int, f32_bytes: int, autocast: bool) -> int:
    return {"act": act_bytes, "f32": f32_bytes, "mask": MASK_BYTES, "cast": act_bytes if autocast else 0}[dtype]


def saved_bytes_per_token(
    entries: tuple[Saved, ...],
    spec: ModelSpec,
    act_bytes: int,
    autocast: bool,
    trains: Callable[[str], bool],
    f32_bytes: int = DTYPE_BYTES_F32,
    seq_len: int = 0,
) -> float:
    """Bytes per token that `entries` keep, given which weights train.

    `f32_bytes` is 2 where the whole model runs in 16 bits (ZeRO mixed precision: no fp32 residual stream)."""
    w = widths(spec, seq_len)
    seen: set[str] = set()
    total = 0.0
    for e in entries:
        if e.weight is not None and not trains(e.weight):
            continue
        n = w[e.width] * e.mult
        if autocast and e.linear and e.dtype == "f32":
            total += act_bytes * n  # a fresh 16-bit cast per linear layer
            continue
        if e.source is not None:
            if e.source in seen:
                continue
            seen.add(e.source)
        total += _dtype_bytes(e.dtype, act_bytes, f32_bytes, autocast) * n
    return total


def largest_tensor_bytes_per_token(spec: ModelSpec, act_bytes: int) -> int:
    """The widest single intermediate of a layer, per token (sizes the working buffers of one layer)."""
    w = widths(spec)
    return max(
        _dtype_bytes(e.dtype, act_bytes, DTYPE_BYTES_F32, False) * w[e.width] * e.mult for e in layer_inventory(spec)
    )


# --- a forward pass without autograd ---------------------------------------------------------------------------

# Through every layer the model's forward keeps the embedding output (a local of the model's forward) and the
# layer loop keeps the layer's input: two fp32 residual-stream tensors on top of a layer's own moments.
NO_GRAD_HELD = 2
# Reserved but unallocated memory of a no-grad forward, in fp32 hidden-sized tensors per token (calibrated). Each
# layer frees and allocates again tensors of three sizes (fp32 hidden, 16-bit hidden, MLP width); the caching
# allocator places them best fit, and the holes the MLP's wider tensors cannot reuse stay reserved: 3.0 per token
# for BERT-base's frozen encoder on an H200 (108.1 GiB reserved at 28653 sequences, 1.47 GiB at 256, over the
# tensors counted here). Replaying the probe step's allocations (recorded on the CPU) through that best-fit
# placement gave 2.0-3.0 for LayerNorm models (BERT-base, GPT-2 small; bf16, fp32; with or without dropout) and
# 0-0.5 for Llama-style RMSNorm models.
NO_GRAD_HOLES = {"layernorm": 3.0, "rmsnorm": 0.5}


def no_grad_holes(spec: ModelSpec) -> float:
    return NO_GRAD_HOLES["layernorm" if spec.model_type in ("bert", "roberta", "distilbert", "gpt2") else "rmsnorm"]


def _no_grad_activation(spec: ModelSpec) -> tuple[Saved, ...]:
    """The MLP activation's tensors at its peak, besides its input (the up projection)."""
    if spec.activation in GELU_NEW:
        # 0.5 * x is evaluated first; then pow (fp32 under autocast: it casts x) and each later op makes a new
        # fp32 tensor from the previous one: two fp32 temporaries at a time
        return (Saved("0.5 * x", "f", "act"), Saved("fp32 temporaries", "f", "f32", mult=2))
    return (Saved("activation output", "f", "act"),)


def _dropped(spec: ModelSpec, what: str) -> tuple[Saved, ...]:
    """A projection that goes through dropout: dropout's output is a new tensor, made next to a 1-byte mask."""
    if spec.hidden_dropout > 0:
        return (Saved(what, "h", "act"), Saved(f"{what} after dropout", "h", "act"), Saved("dropout mask", "h", "mask"))
    return (Saved(what, "h", "act"),)


def no_grad_moments(spec: ModelSpec, padded: bool = False) -> tuple[tuple[Saved, ...], ...]:
    """The peak moments of one layer's forward when nothing keeps tensors for backward, each a tuple of what is
    alive at once besides the NO_GRAD_HELD residual tensors. `padded`: the encoder's mask becomes an attention
    bias of the compute dtype in every layer."""
    t = spec.model_type
    if t in ("bert", "roberta", "distilbert"):
        bias = (Saved("attention mask as a bias", "seq", "act"),) if padded else ()
        attention_output = Saved("attention output", "q", "act")
        block_output = Saved("attention block output", "h", "f32")  # the MLP's input, alive through the MLP
        norm = (Saved("residual sum", "h", "f32"), Saved("LayerNorm output", "h", "f32"))
        act_out = Saved("activation output", "f", "f32" if spec.activation in GELU_NEW else "act")
        return (
            (Saved("q", "q", "act"), Saved("k", "kv", "act"), Saved("v", "kv", "act"), attention_output, *bias),
            (attention_output, Saved("projection after dropout", "h", "act"), *norm),
            (block_output, Saved("up projection", "f", "act"), *_no_grad_activation(spec)),
            (block_output, act_out, Saved("down projection after dropout", "h", "act"), *norm),
        )
    if t == "gpt2":
        norm_out = Saved("ln_1 / ln_2 output", "h", "f32")
        return (
            (norm_out, Saved("q, k, v (one tensor)", "q", "act", mult=3), *_dropped(spec, "c_proj output")),
            # the block keeps the attention output (a local) and the residual sum through the MLP
            (
                Saved("attention output", "h", "act"),
                Saved("residual sum", "h", "f32"),
                norm_out,
                Saved("up projection", "f", "act"),
                *_no_grad_activation(spec),
            ),
        )
    # Llama-style: RoPE makes fp32 q*cos, rotate_half(q)*sin and their sum (cos/sin follow the fp32 residual
    # stream); SDPA's autocast casts the rotated q and k back to 16 bits
    normed = Saved("RMSNorm output", "h", "f32")
    v = Saved("v", "kv", "act")
    return (
        (normed, Saved("q", "q", "act"), Saved("k", "kv", "act"), v, Saved("RoPE temporaries of q", "q", "f32", 3)),
        (
            normed,
            Saved("rotated q", "q", "f32"),
            Saved("rotated k", "kv", "f32"),
            v,
            Saved("16-bit q", "q", "cast"),
            Saved("16-bit k", "kv", "cast"),
            Saved("attention output", "q", "act"),
        ),
        (Saved("residual sum", "h", "f32"), normed, Saved("SiLU output, up output, their product", "f", "act", 3)),
    )


def no_grad_bytes_per_token(
    spec: ModelSpec, act_bytes: int, autocast: bool, f32_bytes: int = DTYPE_BYTES_F32, seq_len: int = 0
) -> float:
    """Live bytes per token at the peak of a no-grad forward: the held residual tensors and the largest moment."""
    w = widths(spec, seq_len)

    def size(entries: tuple[Saved, ...]) -> float:
        return sum(_dtype_bytes(e.dtype, act_bytes, f32_bytes, autocast) * w[e.width] * e.mult for e in entries)

    moments = no_grad_moments(spec, padded=not spec.decoder)
    return NO_GRAD_HELD * f32_bytes * spec.hidden + max(size(m) for m in moments)
