"""Everything the traced tier replaces in transformers and torch for a step on fake tensors, in one module:
`as_real_step` (below), `no_weight_init` (building without initialising), `skips_all_ones_masks` (which attention
builds no mask from an all-ones one), `cuda_kernels` (CUDA's dropout memory where the fake tensors live on the
CPU), `cuda_autocast` (CUDA's autocast op lists where they live on the CPU) and `LayerDropDraws` (the random draw
LayerDrop reads). Each is undone on leaving its context.

transformers' mask code skips building an attention mask when a batch has no padding and no packed sequences, so
that attention takes its causal kernel without a mask tensor. It reads the batch to decide, and decides for a mask
whenever a tensor is fake, as it cannot read one. The traced batch of a decoder has neither padding (it gets no
attention mask) nor packed sequences (positions run 0..n-1 in every row), so a real step of it builds no mask;
`as_real_step` makes the traced step decide the same:
- `masking_utils.find_packed_sequence_indices` answers "not packed" (what reading the positions would say);
- `masking_utils.is_tracing` answers "not tracing" for a fake scalar (the query offset, which the decision never
  reads); every other tensor keeps transformers' answer, so code that would read a fake tensor still steers
  around it.
And mixture-of-experts layers: transformers' `integrations.moe._grouped_mm` (input sorted by expert, a weight per
expert, offsets) runs torch's `grouped_mm`, whose fake kernel takes bf16 inputs only while the layers (fp32 master
weights under autocast) pass fp32 ones, or transformers' own loop, whose backward in transformers 5.17 reads the
offsets (`offs.tolist()`, data a fake tensor does not have). `_grouped_mm` is replaced by a product of the same shapes
that keeps what both keep for backward (the input and the weights) and makes what their backward makes (a gradient of
each), as transformers' fake kernels of its loop do.
These module attributes are not public API: each is overridden only where it exists; without them the trace still
runs, counting the masks a real step would not build, or stopping at a grouped matmul with a message naming it.
"""

from __future__ import annotations

import math
import operator
import warnings
import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map


@contextmanager
def _override(module: Any, name: str, replacement: Any) -> Iterator[bool]:
    original = getattr(module, name, None)
    if original is None:
        yield False
        return
    setattr(module, name, replacement(original))
    try:
        yield True
    finally:
        setattr(module, name, original)


def _scalars_not_tracing(original: Any) -> Any:
    from transformers.utils.import_utils import is_torchdynamo_compiling

    def is_tracing(tensor: Any = None) -> bool:
        if tensor is not None and getattr(tensor, "ndim", None) == 0:
            return bool(is_torchdynamo_compiling())
        return bool(original(tensor))

    return is_tracing


def _never_packed(original: Any) -> Any:
    return lambda position_ids: None


class _GroupedProduct(torch.autograd.Function):
    """The grouped matmul's memory on fake tensors (no values to multiply): its output, what it saves, its gradients."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        return input.new_empty(input.size(0), weight.size(-1))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        input, weight = ctx.saved_tensors
        return torch.empty_like(input), torch.empty_like(weight), None


def _shaped_grouped_mm(original: Any) -> Any:
    def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return _GroupedProduct.apply(input.to(weight.dtype), weight, offs)

    return grouped_mm


@contextmanager
def as_real_step() -> Iterator[list[str]]:
    """Inside it, transformers' mask code decides for the traced batch as for a real one; yields the names of the
    overrides that apply (an empty list where this transformers has none of them)."""
    try:
        from transformers import masking_utils
        from transformers.integrations import moe
    except ImportError:
        yield []
        return
    overrides = (
        (masking_utils, "is_tracing", _scalars_not_tracing),
        (masking_utils, "find_packed_sequence_indices", _never_packed),
        (moe, "_grouped_mm", _shaped_grouped_mm),
    )
    with ExitStack() as stack:
        yield [name for module, name, new in overrides if stack.enter_context(_override(module, name, new))]


@contextmanager
def no_weight_init() -> Iterator[None]:
    """Build models without initialising their weights (fake weights have no values, and some initialisers read
    values: truncated normals). transformers ties the embeddings in the step it skips: call the model's
    `tie_weights()` after building it."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        yield
        return
    with no_init_weights():
        yield


def skips_all_ones_masks(model: Any) -> bool:
    """Whether the model's attention is torch's SDPA, for which transformers builds no mask from an all-ones
    attention mask (eager attention always builds one). `config._attn_implementation` is where transformers keeps
    the implementation it chose; where it is missing, a model is taken to use SDPA, as the planner asks for."""
    return getattr(model.config, "_attn_implementation", "sdpa") == "sdpa"


@contextmanager
def cuda_kernels() -> Iterator[None]:
    """The memory of CUDA's dropout and attention kernels where the fake tensors live on the CPU (functions of
    `torch.nn.functional` replaced for the trace, so that recomputed layers run the same ones):
    - dropout: CUDA's fused kernel keeps a one-byte mask for backward; the CPU's keeps a mask of the input's dtype.
      `F.dropout` runs as `native_dropout` (what CUDA runs), whose mask is boolean on every device.
    - attention with dropout: CUDA's fused kernels keep the random generator's state and redraw the mask in
      backward, so dropout costs them no memory; the CPU's fall back to the unfused path, which keeps the
      sequence-by-sequence attention probabilities and their mask. Attention runs without dropout here, which
      keeps what CUDA's kernels keep.
    """
    with _override(F, "dropout", _native_dropout), _override(F, "scaled_dot_product_attention", _no_dropout):
        yield


def _native_dropout(original: Any) -> Any:
    def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if not training or p == 0.0:
            return input
        return torch.native_dropout(input, p, True)[0]

    return dropout


def _no_dropout(original: Any) -> Any:
    def attention(*args: Any, **kwargs: Any) -> torch.Tensor:
        if len(args) > 4:  # query, key, value, attn_mask, dropout_p, ...
            args = (*args[:4], 0.0, *args[5:])
        if "dropout_p" in kwargs:
            kwargs = {**kwargs, "dropout_p": 0.0}
        return original(*args, **kwargs)

    return attention


_aten = torch.ops.aten
# CUDA's autocast runs these ops in fp32 whatever their inputs (torch's aten/src/ATen/autocast_mode.h, AT_FORALL_FP32;
# the "CUDA Ops that can autocast to float32" of torch's AMP documentation). The CPU's autocast lists none of the
# elementwise ones, so on the CPU `torch.pow` of a bf16 activation stays bf16: GELU-tanh ("gelu_new", GPT-2, Phi)
# computes a chain of fp32 temporaries on CUDA, half the size on the CPU. Names a torch lacks are skipped.
_CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss",
    "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp",
)  # fmt: skip
# ... and these with an fp32 output where the caller gave no dtype (AT_FORALL_FP32_SET_OPT_DTYPE): softmax of bf16
# scores is fp32 on CUDA, bf16 on the CPU
_CUDA_FP32_OUTPUT = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)  # fmt: skip


# ... and these, which the CPU's fp32 list has and CUDA's does not: on CUDA they run through (their parts meet the
# lists: cross_entropy_loss's log_softmax gives fp32 from bf16 logits with no fp32 copy of them first)
_CPU_ONLY_FP32 = ("cross_entropy_loss",)


def _aten_op(name: str) -> Any:
    """The aten overload named "op" or "op.overload", or None where this torch has no such op."""
    packet, _, overload = name.partition(".")
    return getattr(getattr(_aten, packet, None), overload or "default", None)


def _eligible(value: Any) -> bool:
    """What CUDA's autocast casts: floating tensors other than doubles."""
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _fp32_kernel(op: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map(lambda v: v.float() if _eligible(v) else v, (args, kwargs))
        with torch.autocast("cpu", enabled=False):  # the op's own parts run uncast, as under CUDA's autocast
            return op(*args, **kwargs)

    return kernel


def _fp32_output_kernel(op: Any) -> Any:
    """None where the op's schema (where its dtype argument is) cannot be read: the op keeps the CPU's policy."""
    schema = getattr(op, "_schema", None)  # not public API: an OpOverload's schema
    names = [argument.name for argument in getattr(schema, "arguments", ())]
    if "dtype" not in names:
        return None
    at = names.index("dtype")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        given = args[at] if at < len(args) else kwargs.get("dtype")
        if given is None and _eligible(args[0]):
            args, kwargs = (), {**dict(zip(names, args)), **kwargs, "dtype": torch.float32}
        with torch.autocast("cpu", enabled=False):
            return op(*args, **kwargs)

    return kernel


@contextmanager
def cuda_autocast() -> Iterator[list[str]]:
    """Inside it, CPU autocast follows CUDA's fp32 lists (the CPU's lower-precision list, matrix products and
    attention, is CUDA's already): a kernel for each listed op at the AutocastCPU dispatch key, through
    `torch.library`, removed on leaving. Yields the ops overridden. Not covered: CUDA's "promote" list (index_put,
    scatter_add, addcmul, ... run in the widest input dtype), which models rarely give mixed bf16/fp32 inputs."""
    library = torch.library.Library("aten", "IMPL")
    done: list[str] = []
    with warnings.catch_warnings():  # the CPU lists the losses too (fp32 as well): replacing them is the point
        warnings.filterwarnings("ignore", r"(?s).*Overriding a previously registered kernel")
        passing = (_CPU_ONLY_FP32, lambda op: torch.library.fallthrough_kernel)
        for names, make in ((_CUDA_FP32, _fp32_kernel), (_CUDA_FP32_OUTPUT, _fp32_output_kernel), passing):
            for name in names:
                op = _aten_op(name)
                kernel = make(op) if op is not None else None
                if kernel is not None:
                    library.impl(op, kernel, "AutocastCPU")
                    done.append(name)
    try:
        yield done
    finally:
        del library  # unregisters its kernels: the CPU's own policy again


_COMPARISONS = {
    _aten.lt.Scalar: operator.lt,
    _aten.le.Scalar: operator.le,
    _aten.gt.Scalar: operator.gt,
    _aten.ge.Scalar: operator.ge,
    _aten.eq.Scalar: operator.eq,
    _aten.ne.Scalar: operator.ne,
}
# the draw that skips no layer: LayerDrop skips one when the draw falls below its probability, and rand draws in [0, 1)
_KEEPS_EVERY_LAYER = math.nextafter(1.0, 0.0)


class LayerDropDraws(TorchDispatchMode):
    """LayerDrop reads a random number in Python: `if torch.rand([]) < self.layerdrop: continue` (OPT, BART, Whisper,
    wav2vec2 and others; transformers 5.17's OPT draws even with layerdrop 0, modeling_opt.py:374-375), which a fake
    tensor cannot give (`aten._local_scalar_dense` of a value that depends on the data). Inside this mode a draw of
    one number holds the largest value below 1, so that no layer is skipped: the step keeps every layer, the most
    memory a LayerDrop step takes. Its comparison with a number, and reading that, are answered from it; every other
    read of a fake value still fails with the op named. Enter it inside `FakeTensorMode`."""

    def __init__(self) -> None:
        super().__init__()
        self._known: dict[int, tuple[weakref.ref[torch.Tensor], Any]] = {}

    def _value(self, tensor: Any) -> Any:
        entry = self._known.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def _remember(self, tensor: torch.Tensor, value: Any) -> None:
        self._known[id(tensor)] = (weakref.ref(tensor), value)
        weakref.finalize(tensor, self._known.pop, id(tensor), None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        known = self._value(args[0]) if args else None
        if func is _aten._local_scalar_dense.default and known is not None:
            return known
        out = func(*args, **(kwargs or {}))
        if func is _aten.rand.default and out.numel() == 1:
            self._remember(out, _KEEPS_EVERY_LAYER)
        elif func in _COMPARISONS and known is not None and isinstance(args[1], (int, float)):
            self._remember(out, _COMPARISONS[func](known, args[1]))
        return out
