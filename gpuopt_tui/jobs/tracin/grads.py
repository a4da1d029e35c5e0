"""Per-example gradients of the chosen parameters, kept in a form whose inner products are cheap.

Two ways to get them:
- closed form, when every chosen parameter is the weight or bias of an nn.Linear: one batched forward with
  hooks that record each chosen layer's input a (and recompute its output z in full precision), one
  backward of the summed losses to those outputs only. The per-example gradients are then g a^T (weight)
  and g (bias) with g = dL/dz. Nothing below the first chosen layer needs a graph, so the trunk runs as
  under no_grad, in the autocast precision. A layer applied to one vector per example keeps its weight
  gradient factored as (g, a): <g a^T, g' a'^T> = (g.g')(a.a').
- vmap: `torch.func.vmap(torch.func.grad(...))` over the adapter's functional loss, for any parameters.
- factored: hooks on every Linear, Embedding and LayerNorm layer, gradients projected token by token without
  forming them (factored.py); all layers at about the cost of one forward and backward pass.

Both assume that an example's loss depends on that example alone (true for models in eval mode).

With Adam preconditioning (adam_state.py) every gradient is kept dense (a factored g a^T is formed), so that the
elementwise transform of the training gradients applies and test and training features share one layout.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.profiles.tracin import GRADIENT_METHODS
from gpuopt_tui.jobs.attention import padded_batch_kernels
from gpuopt_tui.jobs.device import autocast
from gpuopt_tui.jobs.models.base import Adapter
from gpuopt_tui.jobs.tracin.adam_state import AdamState
from gpuopt_tui.jobs.tracin.factored import FactoredGradients
from gpuopt_tui.jobs.tracin.params import only_these_require_grad
from gpuopt_tui.jobs.tracin.project import Projector

#: A parameter's per-example gradient: dense [B, *shape], or the factors (g [B, m], a [B, n]) of g a^T.
Block = Tensor | tuple[Tensor, Tensor]


@dataclass
class GradFeatures:
    """Per-example gradients of B examples: `dense` [B, D] holds flattened (or projected) gradients and
    `outer` the factored Linear-weight gradients. TracIn scores are inner products of these. Preconditioned
    training gradients Γ(g) carry `self_dot` [B], <Γ(g), g> taken before any projection."""

    dense: Tensor
    outer: list[tuple[Tensor, Tensor]]
    self_dot: Tensor | None = None

    def __len__(self) -> int:
        return self.dense.shape[0]

    def inner(self, other: GradFeatures) -> Tensor:
        """[len(self), len(other)] gradient inner products."""
        scores = self.dense @ other.dense.T
        for (g, a), (g2, a2) in zip(self.outer, other.outer, strict=True):
            scores += (g @ g2.T) * (a @ a2.T)
        return scores

    def self_products(self) -> Tensor:
        """[B] each example's gradient with itself: `self_dot` where set, else the squared norms."""
        if self.self_dot is not None:
            return self.self_dot
        norms = self.dense.square().sum(1)
        for g, a in self.outer:
            norms += g.square().sum(1) * a.square().sum(1)
        return norms

    @classmethod
    def empty(cls, like: GradFeatures, n: int) -> GradFeatures:
        """Room for `n` examples of the same layout as `like` (filled with `put`)."""
        outer = [(g.new_empty(n, g.shape[1]), a.new_empty(n, a.shape[1])) for g, a in like.outer]
        self_dot = like.self_dot.new_empty(n) if like.self_dot is not None else None
        return cls(like.dense.new_empty(n, like.dense.shape[1]), outer, self_dot)

    def put(self, offset: int, part: GradFeatures) -> None:
        """Copy `part` into rows offset .. offset + len(part)."""
        rows = slice(offset, offset + len(part))
        self.dense[rows] = part.dense
        for (g, a), (pg, pa) in zip(self.outer, part.outer, strict=True):
            g[rows], a[rows] = pg, pa
        if self.self_dot is not None and part.self_dot is not None:
            self.self_dot[rows] = part.self_dot


def linear_owners(model: nn.Module, names: Sequence[str]) -> dict[str, tuple[str, nn.Linear, str]] | None:
    """parameter name -> (module name, Linear, "weight" or "bias") when every chosen parameter belongs to
    exactly one nn.Linear (a weight shared with another module would miss its other uses); else None."""
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((mod_name, module, attr))
    params = dict(model.named_parameters())
    found: dict[str, tuple[str, nn.Linear, str]] = {}
    for name in names:
        uses = owners.get(id(params[name]), [])
        if len(uses) != 1 or not isinstance(uses[0][1], nn.Linear):
            return None
        mod_name, module, attr = uses[0]
        found[name] = (mod_name, module, attr)  # type: ignore[assignment]
    return found


class GradientComputer:
    """Computes `GradFeatures` of batches for one set of parameters, the same way for train and test."""

    def __init__(
        self,
        adapter: Adapter,
        names: Sequence[str],
        *,
        method: str = "auto",
        precision: str = "fp32",
        projector: Projector | None = None,
        gradient_checkpointing: bool = False,
        factored_sizes: tuple[int, int] = (0, 0),
        seed: int = 0,
        dense: bool = False,
    ) -> None:
        """`dense`: keep every gradient dense, as Adam preconditioning (`preconditioned`) needs."""
        if not names:
            raise UserError("no parameters chosen for TracIn")
        if method not in GRADIENT_METHODS:
            raise UserError(f"method must be one of {', '.join(GRADIENT_METHODS)}, got {method!r}")
        self.adapter = adapter
        self.model = adapter.model
        self.names = list(names)
        self.precision = precision
        self.projector = projector
        self.gradient_checkpointing = gradient_checkpointing
        self.dtype = torch.promote_types(next(self.model.parameters()).dtype, torch.float32)
        self.factored: FactoredGradients | None = None
        self.dense = dense
        self.adam: AdamState | None = None  # set on the copy `preconditioned` makes for training gradients
        if method == "factored":
            if dense:
                raise UserError(
                    'tracin.optimizer_state = "adam" transforms each gradient elementwise, which method = factored '
                    "(per-layer outer products projected token by token) cannot do: choose method = closed_form or "
                    'vmap (with projection_dim to project), or optimizer_state = "off"'
                )
            if gradient_checkpointing or projector is not None:
                raise UserError(
                    "method = factored projects with projection_in and projection_out (projection_dim must be 0) "
                    "and does not take gradient_checkpointing"
                )
            k_in, k_out = factored_sizes
            self.factored = FactoredGradients(
                adapter, self.names, k_in=k_in, k_out=k_out, seed=seed, precision=precision
            )
            if not self.factored.names:
                raise UserError(
                    "method = factored: none of the chosen parameters is in a Linear, Embedding or LayerNorm"
                )
            self.method = "factored"
            return
        owners = linear_owners(self.model, self.names) if method != "vmap" else None
        if method == "closed_form" and owners is None:
            raise UserError(
                "method = closed_form needs every chosen parameter to be the weight or bias of an nn.Linear "
                "used once; choose other layers or method = vmap"
            )
        self.method = "closed_form" if owners is not None else "vmap"
        self._owners = owners or {}
        if gradient_checkpointing and self.method == "vmap":
            raise UserError(
                "gradient_checkpointing needs the closed-form gradients (torch.func's vmap(grad) cannot "
                "recompute activations); choose Linear layers only, or turn it off"
            )

    def preconditioned(self, state: AdamState) -> GradientComputer:
        """A computer of the same gradients, each transformed by `state` (training examples' Γ(g))."""
        if not self.dense:
            raise ValueError("Adam preconditioning needs a GradientComputer made with dense=True")
        twin = copy.copy(self)
        twin.adam = state
        return twin

    def features(self, batch: Mapping[str, Tensor]) -> GradFeatures:
        # the lean forward of BERT-style heads, unless the layers are to be recomputed (it bypasses that)
        lean = contextlib.nullcontext() if self.gradient_checkpointing else self.adapter.logits_only()
        with lean, padded_batch_kernels(batch.get("attention_mask")):
            if self.factored is not None:
                return GradFeatures(self.factored.features(batch), [])
            blocks = self._closed_form(batch) if self.method == "closed_form" else self._vmap(batch)
        return self._assemble(blocks, len(next(iter(batch.values()))))

    # -- vmap ---------------------------------------------------------------------------------------------
    def _vmap(self, batch: Mapping[str, Tensor]) -> list[tuple[str, Block]]:
        wanted = set(self.names)
        params = {n: p.detach() for n, p in self.model.named_parameters() if n in wanted}
        adapter = self.adapter

        def one(p: dict[str, Tensor], example: dict[str, Tensor]) -> Tensor:
            row = {k: v.unsqueeze(0) for k, v in example.items()}
            return adapter.functional_loss(p, row)[0]

        # The outer no_grad keeps autograd from recording the module's own parameters; grad() still
        # differentiates `p`.
        try:
            with torch.no_grad(), autocast(adapter.device, self.precision):
                grads = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0))(params, dict(batch))
        except RuntimeError as exc:
            if "vmap" not in str(exc) or "data-dependent" not in str(exc):
                raise
            raise UserError(
                f"{adapter.name}: the model's forward branches on tensor values, which torch.func.vmap cannot "
                "run per example; choose Linear layers only (method = closed_form) or adapt the model's inputs"
            ) from exc
        return [(n, grads[n]) for n in self.names]

    # -- closed form -----------------------------------------------------------------------------------------
    def _closed_form(self, batch: Mapping[str, Tensor]) -> list[tuple[str, Block]]:
        modules = {mod_name: module for mod_name, module, _ in self._owners.values()}
        records: dict[str, list[tuple[Tensor, Tensor]]] = {m: [] for m in modules}
        capturing = [True]

        def hook_for(mod_name: str) -> Callable[..., Tensor]:
            def hook(module: nn.Linear, args: tuple, kwargs: dict, output: Any) -> Tensor:
                a = args[0] if args else kwargs["input"]
                with torch.autocast(a.device.type, enabled=False):
                    z = F.linear(a.to(module.weight.dtype), module.weight, module.bias)
                if capturing[0]:  # not when checkpointing recomputes the forward in the backward pass
                    records[mod_name].append((a.detach(), z))
                return z

            return hook

        handles = [m.register_forward_hook(hook_for(n), with_kwargs=True) for n, m in modules.items()]
        try:
            with only_these_require_grad(self.model, self.names), self._recompute():
                with autocast(self.adapter.device, self.precision):
                    losses = self.adapter.loss_per_example(batch)
                capturing[0] = False
                zs = [z for calls in records.values() for _, z in calls]
                grads = torch.autograd.grad(losses.sum(), zs, allow_unused=True) if zs else ()
        finally:
            for handle in handles:
                handle.remove()
        n = losses.shape[0]
        dz = iter(grads)
        per_module: dict[str, tuple[Tensor, Tensor]] = {}  # [B, positions, out], [B, positions, in]
        for mod_name, calls in records.items():
            if not calls:
                continue
            outs, ins = [], []
            for a, z in calls:  # every call of the layer adds its positions
                g = next(dz)
                outs.append(_rows(torch.zeros_like(z) if g is None else g, n, mod_name))
                ins.append(_rows(a, n, mod_name))
            per_module[mod_name] = (torch.cat(outs, 1).to(self.dtype), torch.cat(ins, 1).to(self.dtype))
        blocks: list[tuple[str, Block]] = []
        for name in self.names:
            mod_name, module, attr = self._owners[name]
            if mod_name not in per_module:  # the layer did not run: zero gradient
                shape = getattr(module, attr).shape
                blocks.append((name, torch.zeros(n, *shape, device=self.adapter.device, dtype=self.dtype)))
                continue
            g, a = per_module[mod_name]
            if attr == "bias":
                blocks.append((name, g.sum(1)))
            elif a.shape[1] == 1:
                blocks.append((name, (g[:, 0], a[:, 0])))
            else:
                blocks.append((name, torch.einsum("bpo,bpi->boi", g, a)))
        return blocks

    @contextlib.contextmanager
    def _recompute(self) -> Iterator[None]:
        """Gradient checkpointing for the backward pass. Hugging Face layers only checkpoint in training
        mode, so the training flag is set on those layers alone: dropout and the like stay in eval mode."""
        if not self.gradient_checkpointing:
            yield
            return
        self.adapter.set_gradient_checkpointing(True)
        layers = [m for m in self.model.modules() if getattr(m, "gradient_checkpointing", False) is True]
        if not layers:
            self.adapter.set_gradient_checkpointing(False)
            raise UserError(f"{self.adapter.name}: the model does not support gradient checkpointing")
        for m in layers:
            m.training = True
        try:
            yield
        finally:
            for m in layers:
                m.training = False
            self.adapter.set_gradient_checkpointing(False)
            # Hugging Face's enable also hooks the input embeddings to require grad; disable leaves that hook,
            # which would make every later trunk forward build a graph.
            if hasattr(self.model, "disable_input_require_grads"):
                self.model.disable_input_require_grads()

    # -- both --------------------------------------------------------------------------------------------------
    def _assemble(self, blocks: list[tuple[str, Block]], n: int) -> GradFeatures:
        dense: list[Tensor] = []
        outer: list[tuple[Tensor, Tensor]] = []
        proj = self.projector
        device = self.adapter.device
        self_dot = torch.zeros(n, device=device, dtype=self.dtype) if self.adam is not None else None
        for name, block in blocks:
            if isinstance(block, tuple) and not self.dense:
                g, a = (t.to(device, self.dtype) for t in block)
                outer.append(proj.outer(name, g, a) if proj else (g, a))
                continue
            if isinstance(block, tuple):
                block = torch.einsum("bo,bi->boi", *block)
            x = block.to(device, self.dtype)
            if self.adam is not None and self_dot is not None:
                raw, x = x, self.adam.precondition(name, x)
                self_dot += (x * raw).reshape(n, -1).sum(1)
            dense.append(proj.dense(name, x) if proj else x.reshape(n, -1))
        flat = torch.cat(dense, 1) if dense else torch.zeros(n, 0, device=device, dtype=self.dtype)
        return GradFeatures(flat, outer, self_dot)


def _rows(t: Tensor, n: int, mod_name: str) -> Tensor:
    """[n, positions, features] view of a layer input/output whose first dimension is the example."""
    if t.shape[0] != n:
        raise UserError(
            f"layer {mod_name}: its input does not have the example dimension first ({tuple(t.shape)}); "
            "use method = vmap"
        )
    return t.reshape(n, -1, t.shape[-1])
