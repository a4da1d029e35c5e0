"""A dispatch-mode memory tracker: every tensor storage an op makes, with the module and the phase of the step
that made it, until it is freed; the peak of live bytes and what was alive at that moment.

It sees what torch's dispatcher sees, so it works the same on fake tensors (no memory behind them) as on real
ones. It does not see allocations inside a kernel that never become tensors (cuBLAS workspaces), nor the
caching allocator's rounding and fragmentation: the planner adds those from its allocator model.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# what a storage holds, as the planner's component table names it
WEIGHTS, BATCH, GRADIENTS, OPTIMIZER = "weights", "batch", "gradients", "optimizer"
ACTIVATIONS, CAST, RECOMPUTE, TEMPORARIES = "activations", "cast_cache", "recompute", "temporaries"
# phases of a step, in the order they run
FORWARD, BACKWARD, OPTIMIZER_STEP, SETUP = "forward", "backward", "optimizer step", "setup"
_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")


@dataclass
class Block:
    """One storage: its size and what it holds (`kind` changes when a temporary becomes a gradient, say)."""

    nbytes: int
    kind: str
    module: str  # the innermost module running when it was made ("" outside any module)
    phase: str
    step: int


def module_group(path: str) -> str:
    """A module path with layer indices folded: "model.layers.3.mlp.up_proj" -> "model.layers.*.mlp.up_proj"."""
    return _LAYER_INDEX.sub(".*", path)


class MemoryTrace(TorchDispatchMode):
    """Live storages and their peak, attributed. Enter it, call `watch(model)` for module attribution, `add`
    tensors that existed before, and set `phase` as the step goes; `peak_blocks` is what was alive at the peak."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, Block] = {}
        self._weights: set[int] = set()
        self._modules: list[str] = []
        self.phase = SETUP
        self.step = 0
        self.live = 0
        self.peak = 0
        self.peak_blocks: list[Block] = []
        self.peak_phase = SETUP
        self.peak_module = ""
        self.peak_step = 0
        self._rising = False  # live bytes reached a new peak that no snapshot holds yet
        self._last_module = ""

    # -- registration -----------------------------------------------------------------------------------------

    def add(self, tensor: torch.Tensor, kind: str) -> None:
        """Count a tensor made before the trace (weights, the batch, state from an earlier step)."""
        self._track(tensor, kind).kind = kind
        if kind == WEIGHTS:
            self._weights.add(tensor.untyped_storage()._cdata)

    def relabel(self, tensor: torch.Tensor, kind: str) -> None:
        """Say what a live storage turned out to be (a gradient once accumulated, optimizer state after a step)."""
        block = self._live.get(tensor.untyped_storage()._cdata)
        if block is None:
            self.add(tensor, kind)
        else:
            block.kind = kind

    @contextmanager
    def watch(self, model: nn.Module) -> Iterator[None]:
        """Attribute what is made inside each module of `model` to that module (the innermost one running)."""
        names = {id(m): name for name, m in model.named_modules()}

        def enter(module: nn.Module, args: Any) -> None:
            self._modules.append(names.get(id(module), type(module).__name__))

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            if self._modules:
                self._modules.pop()

        handles = [
            handle
            for m in model.modules()
            for handle in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave, always_call=True))
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    # -- tracking ---------------------------------------------------------------------------------------------

    def _track(self, tensor: torch.Tensor, kind: str, module: str = "") -> Block:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return self._live[key]
        nbytes = storage.nbytes()
        block = Block(nbytes, kind, module, self.phase, self.step)
        self._live[key] = block
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live
            self._rising = True
            self._last_module = module
        weakref.finalize(storage, self._freed, key)
        return block

    def _freed(self, key: int) -> None:
        if self._rising:
            self.snapshot()
        block = self._live.pop(key, None)
        if block is not None:
            self.live -= block.nbytes

    def snapshot(self) -> None:
        """Keep what is alive now as the peak's contents (called when live bytes fall from a new peak)."""
        if not self._rising:
            return
        self._rising = False
        self.peak_blocks = list(self._live.values())
        self.peak_phase, self.peak_step, self.peak_module = self.phase, self.step, self._last_module

    def _kind(self, func: Any, args: Any) -> str:
        if self.phase == FORWARD:
            first = args[0] if args else None
            copy = func is torch.ops.aten._to_copy.default and isinstance(first, torch.Tensor)
            if copy and first.untyped_storage()._cdata in self._weights:
                return CAST  # autocast's 16-bit copy of a weight
            return ACTIVATIONS
        if self.phase == BACKWARD and self._modules:
            return RECOMPUTE  # a module's forward running inside backward: gradient checkpointing
        return TEMPORARIES

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        module = self._modules[-1] if self._modules else ""
        kind: str | None = None
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.untyped_storage()._cdata not in self._live:
                kind = kind or self._kind(func, args)
                self._track(leaf, kind, module)
        return out


def grad_relabeller(trace: MemoryTrace, params: list[nn.Parameter]) -> Callable[[], None]:
    """Mark each gradient as a gradient once autograd accumulated it; returns what removes the hooks."""

    def hook(param: torch.Tensor) -> None:
        if param.grad is not None:
            trace.relabel(param.grad, GRADIENTS)

    handles = [p.register_post_accumulate_grad_hook(hook) for p in params]

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove
