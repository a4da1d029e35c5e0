"""Per-example gradients of every Linear, Embedding and LayerNorm parameter, projected without forming them.

The gradient of a Linear weight for one example is a sum over its tokens of outer products g_t x_t^T (g: the
gradient of the loss with respect to the layer's output, x: its input). Its projection P_out^T (sum_t g_t x_t^T)
P_in equals sum_t (P_out^T g_t)(P_in^T x_t)^T, so a forward hook projects each token's input and a hook on the
output's gradient projects g_t and sums the small outer products per example: the d_out x d_in gradient is never
formed (the LoGra factorisation). An Embedding is a Linear layer fed one-hot token ids (P_in^T x_t is a row of
P_in); transformers' Conv1D is a Linear layer stored transposed. Biases (sum_t g_t) and LayerNorm parameters
(sum_t g_t * x_hat_t and sum_t g_t) are vectors, projected densely to `k_out` numbers. A size of 0, or one at
least the dimension, keeps that side exact (no projection), so sizes 0 give exact per-example gradients.

One forward and one backward per micro-batch: a hooked layer's output that needs no gradient (the first one:
nothing before it requires one) gets a zero scalar added that requires grad, which every later output then depends
on (when something before the first layer required grad, every output gets it), and the backward differentiates the
summed loss with respect to that scalar only, so no parameter gradient is computed and each layer's g is projected
(and freed) as soon as the backward reaches it (a hook on the output tensor). Tokens where the attention mask is 0
contribute nothing: one side of each product is zeroed there. A layer run on a batch of one while the batch has
more examples (shared position ids) is expanded to the examples, so each gets its own gradient. Parameters these
products would get wrong (of other modules, of subclasses with a forward of their own, or tied to such a module)
are left out; `excluded` maps each to the reason.

Projections are seeded per parameter and axis (`Projector.factor`), the same for training and test examples.
The forward may run under bf16/fp16 autocast; a layer's input and output gradient are then projected as they come
(bf16 matrix products accumulate in fp32; only their k-wide results are rounded, like every activation of such a
forward), so no full-width fp32 copy of an activation is made, and the k-wide results are widened to fp32 (float64
for float64 models) before the sums over tokens. Padded tokens are zeroed after the projection (the same numbers:
a row scaled by 0 or 1). LayerNorm weights need g * x_hat at full width, which is formed in fp32 (x_hat zeroed on
padded tokens in the forward).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpuopt_tui.jobs.device import autocast
from gpuopt_tui.jobs.models.base import Adapter
from gpuopt_tui.jobs.tracin.lora_layers import LoraLayer, lora_layers, plain_forwards, variant_parameters
from gpuopt_tui.jobs.tracin.params import only_these_require_grad
from gpuopt_tui.jobs.tracin.project import Projector

# each matrix role's axes, in its parameter's layout: "in" the layer's input side, "out" its output side (an
# embedding's input is the one-hot token)
MATRIX_SIDES = {
    "weight": ("out", "in"),
    "lora_a": ("out", "in"),
    "lora_b": ("out", "in"),
    "conv_weight": ("in", "out"),
    "embedding": ("in", "out"),
}


@dataclass(frozen=True)
class Use:
    """One chosen parameter of one module: `role` is weight, conv_weight (stored [in, out]), embedding, bias,
    norm_weight, norm_bias, or lora_a / lora_b (a PEFT LoRA layer's adapter matrices, lora_layers.py)."""

    param: str
    role: str


def _conv1d_type() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


def _factored_roles(module: nn.Module) -> tuple[type | None, dict[str, str]]:
    """(the supported layer type `module` is, the role of each of its parameters); (None, {}) for other modules."""
    conv1d = _conv1d_type()
    if isinstance(module, nn.Linear):
        return nn.Linear, {"weight": "weight", "bias": "bias"}
    if conv1d is not None and isinstance(module, conv1d):
        return conv1d, {"weight": "conv_weight", "bias": "bias"}
    if isinstance(module, nn.Embedding):
        return nn.Embedding, {"weight": "embedding"}
    if isinstance(module, nn.LayerNorm):
        return nn.LayerNorm, {"weight": "norm_weight", "bias": "norm_bias"}
    return None, {}


def _why_not_factored(module: nn.Module, base: type | None) -> str | None:
    """Why the factorisation of `module`'s gradients would be wrong (None: it is exact). It assumes the layer's
    output is its plain product (x W^T + b, a row lookup, a LayerNorm): a subclass with a forward of its own may
    scale it (Gemma's embedding multiplies by sqrt(hidden size)) or use its weight otherwise (1 + weight)."""
    kind = type(module).__name__
    if base is None:
        return f"{kind} is not a Linear, Conv1D, Embedding or LayerNorm layer"
    if type(module).forward is not base.forward:
        return f"{kind} replaces {base.__name__}.forward, so its output need not be the layer's plain product"
    if isinstance(module, nn.Embedding) and module.scale_grad_by_freq:
        return "scale_grad_by_freq scales its gradient by the batch's token counts"
    return None


def module_uses(model: nn.Module, names: Sequence[str]) -> tuple[dict[str, list[Use]], dict[str, str]]:
    """(module name -> the chosen parameters it uses, chosen parameter -> why it is left out). A weight shared by
    several modules (tied embeddings) has a use in each and their contributions add up, so it is left out when
    any module holding it cannot be factored exactly: part of its gradient would be missing. A parameter used
    outside the modules that hold it (a functional call in a parent's forward) is not seen."""
    wanted = set(names)
    canonical = {id(p): n for n, p in model.named_parameters()}
    uses: dict[str, list[Use]] = {}
    why = variant_parameters(model, names)
    for mod_name, module in model.named_modules():
        held = [(attr, canonical[id(p)]) for attr, p in module.named_parameters(recurse=False)]
        held = [(attr, name) for attr, name in held if name in wanted]
        if not held:
            continue
        base, roles = _factored_roles(module)
        problem = _why_not_factored(module, base)
        for attr, name in held:
            if problem is None and attr in roles:
                uses.setdefault(mod_name, []).append(Use(name, roles[attr]))
            else:
                reason = problem or f"{type(module).__name__}.{attr} is not one of its factored parameters"
                why.setdefault(name, f"{mod_name}: {reason}")
    uses = {m: kept for m, found in uses.items() if (kept := [u for u in found if u.param not in why])}
    return uses, {n: why[n] for n in names if n in why}


class FactoredGradients:
    """Projected per-example gradients [B, D] of the chosen parameters, in `names` order (excluded ones left
    out, `excluded`: name -> why); `k_in`, `k_out`: projected sizes of a layer's input and output side (0 = exact)."""

    def __init__(
        self, adapter: Adapter, names: Sequence[str], *, k_in: int, k_out: int, seed: int, precision: str
    ) -> None:
        self.adapter = adapter
        self.model = adapter.model
        self.precision = precision
        self.dtype = torch.promote_types(next(self.model.parameters()).dtype, torch.float32)
        self.uses, self.excluded = module_uses(self.model, names)
        self.lora = lora_layers(self.model, names)
        self.uses = _with_lora_layers(self.uses, self.lora)
        self._lora_sides: dict[str, Tensor] = {}  # A or B -> its combined factor, for the current adapter weights
        self.modules = dict(self.model.named_modules(remove_duplicate=False))
        self.projector = Projector(1, seed, adapter.device, self.dtype)
        self._factors: dict[tuple[str, int, torch.dtype], Tensor] = {}  # (name, axis, x's dtype) -> factor
        self.bases: dict[tuple[str, int], Tensor] = {}  # (name, axis) -> a factor fitted to the data (set_bases)
        params = dict(self.model.named_parameters())
        self.sizes: dict[str, tuple[int, ...]] = {}  # parameter -> projected shape (per axis)
        for found in self.uses.values():
            for use in found:
                if use.param not in self.sizes:
                    self.sizes[use.param] = _projected_shape(use.role, tuple(params[use.param].shape), k_in, k_out)
        self.names = [n for n in names if n in self.sizes]
        self.shapes = {n: tuple(params[n].shape) for n in self.names}

    def size(self) -> int:
        """Numbers per example gradient."""
        return sum(_numel(s) for s in self.sizes.values())

    def features(self, batch: Mapping[str, Tensor]) -> Tensor:
        n = len(next(iter(batch.values())))
        feats: dict[str, Tensor] = {}

        def on_output(uses: list[Use], g: Tensor, n: int, keep: Tensor | None, saved: dict[str, Tensor]) -> None:
            self._output_side(uses, g, n, keep, saved, feats)

        self._lora_sides = self._combined_lora_factors()
        try:
            device = self.run_hooked(batch, self._input_side, on_output)
        finally:
            self._lora_sides = {}
        parts = [feats.get(name) for name in self.names]
        return torch.cat(
            [
                p.reshape(n, -1) if p is not None else torch.zeros(n, _numel(self.sizes[name]), device=device)
                for name, p in zip(self.names, parts)
            ],
            1,
        ).to(self.dtype)

    def set_bases(self, bases: Mapping[tuple[str, int], Tensor]) -> None:
        """Project these sides (parameter, axis) -> [dim, k] with the given factors instead of seeded random ones
        (pca_basis.py fits them to the data); an empty mapping: random factors everywhere again."""
        self.bases = dict(bases)
        self._factors.clear()

    def run_hooked(
        self,
        batch: Mapping[str, Tensor],
        on_input: Callable[[nn.Module, list[Use], Tensor, int, Tensor | None], Any],
        on_output: Callable[[list[Use], Tensor, int, Tensor | None, Any], None],
    ) -> torch.device:
        """One forward and one backward of `batch` (the module docstring): each hooked module's input goes to
        `on_input(module, uses, x, n, keep)`, and its output's gradient, with what `on_input` returned, to
        `on_output(uses, g, n, keep, returned)`; `keep` [n, tokens, 1] is 0 on padded tokens. Returns the device."""
        n = len(next(iter(batch.values())))
        mask = self.adapter.token_mask(batch)
        keep = None if mask is None else mask.reshape(n, -1, 1).to(self.dtype)  # [n, T, 1]
        anchor = torch.zeros((), device=self.adapter.device, dtype=self.dtype, requires_grad=True)
        anchored: list[bool] = []  # [whether outputs that require grad depend on the anchor], at the first hook
        handles = [
            self.modules[name].register_forward_hook(
                self._hook(uses, n, keep, anchor, anchored, on_input, on_output), with_kwargs=True
            )
            for name, uses in self.uses.items()
        ]
        try:
            with only_these_require_grad(self.model, []), plain_forwards(self.lora):
                with autocast(self.adapter.device, self.precision):
                    losses = self.adapter.loss_per_example(batch)
                torch.autograd.grad(losses.sum(), anchor, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        return anchor.device

    def _hook(
        self,
        uses: list[Use],
        n: int,
        keep: Tensor | None,
        anchor: Tensor,
        anchored: list[bool],
        on_input: Callable[[nn.Module, list[Use], Tensor, int, Tensor | None], Any],
        on_output: Callable[[list[Use], Tensor, int, Tensor | None, Any], None],
    ) -> Callable[..., Tensor]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Tensor:
            x = args[0] if args else next(iter(kwargs.values()))
            if output.shape[0] == 1 and n > 1:  # e.g. position embeddings of shared position ids
                output, x = output.expand(n, *output.shape[1:]), x.expand(n, *x.shape[1:])
            # An output that requires grad depends on an anchored one already, unless something before the first
            # hooked layer required grad (an input-gradient hook): then every output is anchored, to be sure.
            if not anchored:
                anchored.append(not output.requires_grad)
            z = output if output.requires_grad and anchored[0] else output + anchor
            with torch.autocast(z.device.type, enabled=False):
                saved = on_input(module, uses, x, n, keep)
            z.register_hook(lambda g: on_output(uses, g, n, keep, saved))
            return z

        return hook

    def _input_side(
        self, module: nn.Module, uses: list[Use], x: Tensor, n: int, keep: Tensor | None
    ) -> dict[str, Tensor]:
        """What the backward needs of the layer's input, per parameter: projected inputs [n, T, k], zero on padded
        tokens (so that the output side needs no mask)."""
        saved: dict[str, Tensor] = {}
        for use in uses:
            if use.role in ("weight", "conv_weight", "lora_a"):
                axis = 0 if use.role == "conv_weight" else 1
                saved[use.param] = masked_padding(self._project(use.param, axis, example_rows(x, n)), keep)
            elif use.role == "lora_b":  # (s A^T P_Bi)^T x_t
                saved[use.param] = masked_padding(self._times(example_rows(x, n), self._lora_sides[use.param]), keep)
            elif use.role == "embedding":
                ids = x.reshape(n, -1)
                live = torch.ones_like(ids, dtype=self.dtype) if keep is None or keep.shape[1] != ids.shape[1] else keep
                live = live.reshape(ids.shape)
                if module.padding_idx is not None:  # that row's gradient is always zero
                    live = live * (ids != module.padding_idx)
                saved[use.param] = self._embedding_rows(use.param, ids, live)
            elif use.role == "norm_weight":
                xhat = F.layer_norm(x.to(self.dtype), module.normalized_shape, eps=module.eps)
                saved[use.param] = masked_padding(example_rows(xhat, n), keep)  # so g * x_hat needs no masked g
        return saved

    def _output_side(
        self,
        uses: list[Use],
        g: Tensor,
        n: int,
        keep: Tensor | None,
        saved: dict[str, Tensor],
        feats: dict[str, Tensor],
    ) -> None:
        g = example_rows(g, n)
        for use in uses:
            name, role = use.param, use.role
            if role in ("weight", "lora_b"):  # sum_t (P_out^T g_t)(P_in^T x_t)^T: [n, k_out, T] @ [n, T, k_in]
                part = torch.bmm(self._project(name, 0, g).transpose(1, 2), saved[name])
            elif role == "lora_a":  # sum_t ((s B P_Ao)^T g_t)(P_Ai^T x_t)^T
                part = torch.bmm(self._times(g, self._lora_sides[name]).transpose(1, 2), saved[name])
            elif role == "conv_weight":
                part = torch.bmm(saved[name].transpose(1, 2), self._project(name, 1, g))
            elif role == "embedding":
                part = self._embedding_grad(name, saved[name], self._project(name, 1, g))
            elif role == "norm_weight":
                part = self._project(name, 0, (g.to(self.dtype) * saved[name]).sum(1))
            else:  # bias, norm_bias: sum_t P^T g_t
                part = masked_padding(self._project(name, 0, g), keep).sum(1)
            part = part.reshape(n, -1)  # a tied weight's uses (embedding, output layer) add up in one layout
            feats[name] = feats[name] + part if name in feats else part

    def _project(self, name: str, axis: int, x: Tensor) -> Tensor:
        """x [..., dim] -> [..., k] along `axis` of parameter `name` (x itself when that side is exact), in the
        engine's dtype; a bf16/fp16 x is multiplied in its own precision (the module docstring says why). One
        matrix product of the flattened tokens: this runs for every chosen tensor twice a micro-batch."""
        if self.sizes[name][axis] == self.shapes[name][axis]:
            return x.to(self.dtype)
        return self._times(x, self._factor(name, axis, x.dtype))

    def _times(self, x: Tensor, matrix: Tensor) -> Tensor:
        """x [..., dim] @ matrix [dim, k], in x's precision when bf16/fp16 (as `_project`), in the engine's dtype."""
        low = x.dtype in (torch.bfloat16, torch.float16)
        matrix = matrix.to(x.dtype if low else self.dtype)
        return torch.mm(x.reshape(-1, x.shape[-1]).to(matrix.dtype), matrix).view(*x.shape[:-1], -1).to(self.dtype)

    def _combined_lora_factors(self) -> dict[str, Tensor]:
        """For each LoRA layer: A -> s B P_Ao [out, k], B -> s A^T P_Bi [in, k] (lora_layers.py), in the engine's
        dtype, from the adapter weights as they are now (each checkpoint loads its own)."""
        sides: dict[str, Tensor] = {}
        for layer in self.lora.values():
            a, b = (m.detach().to(self.dtype) for m in layer.matrices())
            sides[layer.a] = layer.scaling * (b @ self._side(layer.a, 0))
            sides[layer.b] = layer.scaling * (a.T @ self._side(layer.b, 1))
        return sides

    def _side(self, name: str, axis: int) -> Tensor:
        """The projection factor of `name`'s `axis` [dim, k] in the engine's dtype; the identity on an exact side."""
        dim = self.shapes[name][axis]
        if self.sizes[name][axis] == dim:
            return torch.eye(dim, device=self.adapter.device, dtype=self.dtype)
        return self._factor(name, axis, self.dtype)

    def _factor(self, name: str, axis: int, dtype: torch.dtype) -> Tensor:
        """The projection factor of `name`'s `axis`, in `dtype` when that is bf16/fp16, else in the engine's."""
        key = (name, axis, dtype)
        factor = self._factors.get(key)
        if factor is None:
            factor = self.bases.get((name, axis))
            if factor is None:
                factor = self.projector.factor(name, axis, self.shapes[name][axis], self.sizes[name][axis])
            if dtype in (torch.bfloat16, torch.float16):
                factor = factor.to(dtype)
            self._factors[key] = factor
        return factor

    def _embedding_rows(self, name: str, ids: Tensor, live: Tensor) -> Tensor:
        """The input side of an embedding: rows of its projection factor [n, T, k_in], zero where not live;
        exact: the ids themselves with dead tokens as -1."""
        vocab, k = self.shapes[name][0], self.sizes[name][0]
        if k == vocab:
            return ids.masked_fill(live == 0, -1)
        return self.projector.factor(name, 0, vocab, k)[ids] * live[..., None]

    def _embedding_grad(self, name: str, rows: Tensor, g: Tensor) -> Tensor:
        """g: the projected output gradient [n, T, k_out]; `rows` are zero (exact: -1) on padded tokens."""
        vocab, k = self.shapes[name][0], self.sizes[name][0]
        if k != vocab:
            return torch.einsum("btv,btd->bvd", rows, g)
        n, tokens = rows.shape
        out = g.new_zeros(n * vocab, g.shape[-1])
        flat = (rows + vocab * torch.arange(n, device=rows.device)[:, None]).reshape(-1)
        live = rows.reshape(-1) >= 0
        out.index_add_(0, flat[live], g.reshape(n * tokens, -1)[live])
        return out


def _projected_shape(role: str, shape: tuple[int, ...], k_in: int, k_out: int) -> tuple[int, ...]:
    def fit(dim: int, k: int) -> int:
        return dim if k == 0 else min(dim, k)

    sides = MATRIX_SIDES.get(role, ("out",))  # a vector (bias, norm) has its output side only
    return tuple(fit(dim, k_in if side == "in" else k_out) for dim, side in zip(shape, sides))


def _with_lora_layers(uses: dict[str, list[Use]], layers: Mapping[str, LoraLayer]) -> dict[str, list[Use]]:
    """`uses` with each LoRA layer's adapter matrices taken from the layer itself, not from its sub-layers."""
    taken = {name for layer in layers.values() for name in (layer.a, layer.b)}
    kept = {m: rest for m, found in uses.items() if (rest := [u for u in found if u.param not in taken])}
    return kept | {m: [Use(layer.a, "lora_a"), Use(layer.b, "lora_b")] for m, layer in layers.items()}


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def example_rows(t: Tensor, n: int) -> Tensor:
    """[n, tokens, features] view of a layer input/output whose first dimension is the example."""
    return t.reshape(n, -1, t.shape[-1])


def masked_padding(t: Tensor, keep: Tensor | None) -> Tensor:
    """Zero the padded tokens of [n, T, d] (`keep`: [n, tokens, 1]) when T is the batch's token count (a lean layer's
    T is 1; a causal LM's output layer runs on the completion's positions, where the loss's gradient is zero on
    padding)."""
    return t if keep is None or keep.shape[1] != t.shape[1] else t * keep
