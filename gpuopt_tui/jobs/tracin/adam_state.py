"""Adam-preconditioned training gradients (tracin.optimizer_state = "adam"), from each checkpoint's optimizer.pt.

At a checkpoint saved after t optimizer steps, with Adam's moments m, v and hyperparameters β1, β2, ε, a training
example's gradient g is replaced by the update direction one more Adam step would take with it:

    m' = β1·m + (1-β1)·g        v' = β2·v + (1-β2)·g²        (elementwise)
    Γ(g) = m̂ / (sqrt(v̂) + ε)   with m̂ = m' / (1-β1^(t+1)), v̂ = v' / (1-β2^(t+1))

and influence(z, z') = sum_c lr_c · <Γ_c(g_c(z)), g_c(z')>: test (query) gradients stay plain gradients; the
self-influence of z is sum_c lr_c · <Γ_c(g_c(z)), g_c(z)>. Γ is taken per parameter with that parameter's own step
count and its group's β1, β2, ε; AdamW's decoupled weight decay does not depend on g and is left out.

optimizer.pt is what Hugging Face's Trainer saves beside a checkpoint's weights: `torch.save` of
`optimizer.state_dict()`, whose "state" is keyed by parameter index in the order of "param_groups". Indices map to
the trainable parameters (`model.named_parameters()` with requires_grad, in order; for a PEFT adapter its trainable
parameters) either in that order or, with two groups, the Trainer's split: the parameters with weight decay first,
then the others (biases and norm layers). The split that fits every group's size and every tensor's shape wins.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.models.base import Adapter, Checkpoint

OPTIMIZER_FILE = "optimizer.pt"
DESCRIPTION = "Adam-preconditioned training gradients (optimizer.pt of each checkpoint)"
FORMULA = (
    "Γ(g) = m̂/(√v̂+ε), m̂ = (β1·m+(1-β1)·g)/(1-β1^(t+1)), v̂ = (β2·v+(1-β2)·g²)/(1-β2^(t+1)); "
    "influence = Σ_c lr_c·<Γ_c(g_train), g_query>"
)
# parameter names the Trainer keeps out of weight decay (its rule, besides parameters of nn.LayerNorm)
_NO_DECAY = [re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")]


@dataclass(frozen=True)
class AdamSettings:
    """One parameter's Adam hyperparameters and the steps taken before the checkpoint."""

    beta1: float
    beta2: float
    eps: float
    step: int


def optimizer_files(checkpoints: Sequence[Checkpoint]) -> list[Path]:
    """optimizer.pt beside each checkpoint's weights (in its directory); UserError when one is missing or two
    checkpoints would share one."""
    files: list[Path] = []
    for i, ckpt in enumerate(checkpoints):
        folder = ckpt.path if ckpt.path.is_dir() else ckpt.path.parent
        path = folder / OPTIMIZER_FILE
        if not path.is_file():
            raise UserError(
                f'tracin.optimizer_state = "adam": checkpoint {i} ({ckpt.path}) has no {OPTIMIZER_FILE} beside it '
                f"(expected {path}, as a Hugging Face Trainer checkpoint directory holds); set optimizer_state = "
                '"off" to score plain gradients'
            )
        if path in files:
            raise UserError(
                f'tracin.optimizer_state = "adam": checkpoints {files.index(path)} and {i} share {path}; each '
                "checkpoint needs its own directory with its own optimizer state"
            )
        files.append(path)
    return files


def trainable_parameters(adapter: Adapter) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the parameters the trainer optimized, in `named_parameters` order."""
    params = dict(adapter.model.named_parameters())
    names = adapter.peft_trainable or [n for n, p in params.items() if p.requires_grad]
    return [(n, tuple(params[n].shape)) for n in names]


def no_decay_names(model: nn.Module) -> set[str]:
    """Parameters the Trainer optimizes without weight decay: those of nn.LayerNorm layers, biases and norms."""
    found = set()
    for mod_name, module in model.named_modules():
        for attr, _ in module.named_parameters(recurse=False):
            name = f"{mod_name}.{attr}" if mod_name else attr
            if isinstance(module, nn.LayerNorm) or any(p.search(name.lower()) for p in _NO_DECAY):
                found.add(name)
    return found


class AdamState:
    """One checkpoint's Adam moments and settings for the chosen parameters, on `device` in `dtype`."""

    def __init__(
        self, file: Path, moments: dict[str, tuple[Tensor, Tensor]], settings: dict[str, AdamSettings]
    ) -> None:
        self.file, self.moments, self.settings = file, moments, settings

    def precondition(self, name: str, grad: Tensor) -> Tensor:
        """Γ of per-example gradients `grad` [B, *shape] of parameter `name` (see the module's formula)."""
        m, v = self.moments[name]
        s = self.settings[name]
        t = s.step + 1
        m_hat = (s.beta1 * m + (1 - s.beta1) * grad) / (1 - s.beta1**t)
        v_hat = (s.beta2 * v + (1 - s.beta2) * grad.square()) / (1 - s.beta2**t)
        return m_hat / (v_hat.sqrt() + s.eps)

    def describe(self) -> dict[str, Any]:
        """β1, β2, ε and step of the chosen parameters: one value each, or the [lowest, highest] where they differ."""

        def one(values: list[Any]) -> Any:
            return values[0] if len(set(values)) == 1 else [min(values), max(values)]

        found = list(self.settings.values())
        return {
            "file": str(self.file),
            "beta1": one([s.beta1 for s in found]),
            "beta2": one([s.beta2 for s in found]),
            "eps": one([s.eps for s in found]),
            "step": one([s.step for s in found]),
        }


def load_adam_state(
    file: Path, adapter: Adapter, chosen: Sequence[str], device: torch.device, dtype: torch.dtype
) -> AdamState:
    """The Adam state of the parameters `chosen` in `file` (torch.load with weights_only=True); UserError naming the
    file and what was expected when it is not an Adam state of the model's trainable parameters."""
    raw = _read(file)
    trainable = trainable_parameters(adapter)
    names = _index_names(file, raw, trainable, no_decay_names(adapter.model))
    shapes = dict(trainable)
    group_of = {idx: group for group in raw["param_groups"] for idx in group["params"]}
    wanted = set(chosen)
    moments, settings = {}, {}
    for idx, name in names.items():
        if name in wanted:
            m, v, settings[name] = _entry(file, raw["state"].get(idx), idx, name, shapes[name], group_of[idx])
            moments[name] = (m.to(device, dtype), v.to(device, dtype))
    missing = [n for n in chosen if n not in moments]
    if missing:
        raise UserError(
            f"{file}: no optimizer state for {', '.join(missing[:4])}: the parameters scored with "
            'tracin.optimizer_state = "adam" must be ones the trainer optimized (choose them with tracin.layers)'
        )
    return AdamState(file, moments, settings)


def _entry(
    file: Path, entry: Any, idx: int, name: str, shape: tuple[int, ...], group: dict[str, Any]
) -> tuple[Tensor, Tensor, AdamSettings]:
    """(exp_avg, exp_avg_sq, settings) of parameter `name`, state[idx] of `file`, checked."""
    if not isinstance(entry, dict) or "exp_avg" not in entry or "exp_avg_sq" not in entry:
        raise UserError(
            f"{file}: state[{idx}] ({name}) has no exp_avg and exp_avg_sq: expected the state of an Adam or "
            'AdamW optimizer that has taken a step; set tracin.optimizer_state = "off" for other optimizers'
        )
    if group.get("amsgrad") or "max_exp_avg_sq" in entry:
        raise UserError(f"{file}: the optimizer used amsgrad, whose update tracin.optimizer_state = adam lacks")
    for key in ("exp_avg", "exp_avg_sq"):
        if tuple(entry[key].shape) != shape:
            raise UserError(
                f"{file}: state[{idx}][{key!r}] has shape {tuple(entry[key].shape)}, but parameter {name} of the "
                f"model has {shape}: the optimizer state is not of this model (or was flattened by a sharded "
                "optimizer)"
            )
    beta1, beta2 = (float(b) for b in group["betas"])
    settings = AdamSettings(beta1, beta2, float(group["eps"]), int(float(entry.get("step", 0))))
    return entry["exp_avg"], entry["exp_avg_sq"], settings


def _read(file: Path) -> dict[str, Any]:
    """The state dict in `file`, memory-mapped where torch.save wrote its zip format (a full model's optimizer
    state is twice its size; only the chosen parameters' moments are then read)."""
    try:
        try:
            raw = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # not the zip format, which mmap needs; read as a whole
            raw = torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as exc:
        raise UserError(
            f"{file}: cannot read it as a torch optimizer state with weights_only=True ({str(exc).splitlines()[0]})"
        ) from exc
    if (
        not isinstance(raw, dict)
        or not isinstance(raw.get("state"), dict)
        or not isinstance(raw.get("param_groups"), list)
    ):
        raise UserError(f"{file}: expected torch.save(optimizer.state_dict()): a dict with 'state' and 'param_groups'")
    for i, group in enumerate(raw["param_groups"]):
        if not isinstance(group, dict) or not all(k in group for k in ("params", "betas", "eps")):
            raise UserError(f"{file}: param_groups[{i}] lacks params, betas or eps: expected an Adam or AdamW state")
    return raw


def _index_names(
    file: Path, raw: dict[str, Any], trainable: list[tuple[str, tuple[int, ...]]], no_decay: set[str]
) -> dict[int, str]:
    """Parameter index -> name: the trainable parameters in order, or split as the Trainer groups them."""
    indices = [idx for group in raw["param_groups"] for idx in group["params"]]
    names = [n for n, _ in trainable]
    if len(indices) != len(names):
        raise UserError(
            f"{file}: the optimizer holds {len(indices)} parameter tensors in its param_groups, but the model has "
            f"{len(names)} trainable ones ({names[0]}, ...): the optimizer state is not of this model's training"
        )
    sizes = [len(group["params"]) for group in raw["param_groups"]]
    in_order = dict(zip(indices, names))
    decayed = [n for n in names if n not in no_decay]
    split = dict(zip(indices, decayed + [n for n in names if n in no_decay]))
    candidates = [split] if len([s for s in sizes if s]) == 2 and sizes[0] == len(decayed) else []
    candidates.append(in_order)
    shapes = dict(trainable)
    for mapping in candidates:
        if all(_shape(raw, idx) in (None, shapes[name]) for idx, name in mapping.items()):
            return mapping
    idx, name = next((i, n) for i, n in candidates[0].items() if _shape(raw, i) not in (None, shapes[n]))
    raise UserError(
        f"{file}: state[{idx}]['exp_avg'] has shape {_shape(raw, idx)}, but the trainable parameter it stands for, "
        f"{name}, has {shapes[name]}: the optimizer state is not of this model's trainable parameters"
    )


def _shape(raw: dict[str, Any], idx: int) -> tuple[int, ...] | None:
    entry = raw["state"].get(idx)
    if not isinstance(entry, dict) or not isinstance(entry.get("exp_avg"), Tensor):
        return None
    return tuple(entry["exp_avg"].shape)
