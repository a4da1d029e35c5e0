"""The traced tier: the user's model class and training step run on fake tensors, every allocation tracked.

    python -m gpuopt_tui.jobs.plantrace < request.json      # progress lines, then one JSON line

The request is the measured tier's (core/planner/measure.py `probe_request`): the Hugging Face config, the task
and the training setup. The model is built from its config by `AutoModelFor*` (no remote code, no weights) under
`FakeTensorMode`: tensors have shapes, dtypes and devices but no memory, so a 7B model costs no RAM. The setup is
the measured tier's (`memprobe.build_model`: precision, gradient checkpointing, the LoRA adapters the probes use;
the optimizer with its multi-tensor update, torch's default on GPUs), and two steps of the setup's loop run
(`memprobe.training_step`: the first creates the optimizer state) under `tracemem.MemoryTrace`. LoRA does not go
through peft (not a dependency): `memprobe.LoRA` wraps each targeted linear layer with rank-r A and B matrices,
the weights and activations a peft LoRA layer has too (with lora_dropout > 0, peft also keeps a dropped-out copy
of each adapted input, which this does not count).

Fake tensors live on the CPU device here (this build of torch may have no CUDA); the step runs CUDA's autocast op
lists and CUDA's dropout memory all the same (`fakecompat.cuda_autocast`, `fakecompat.cuda_kernels`), as the plan is
for a GPU. `trace_device` = "cuda" fakes CUDA tensors where torch has CUDA.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)

from gpuopt_tui.core.planner.model_spec import ENCODERS
from gpuopt_tui.core.planner.traced import PROGRESS
from gpuopt_tui.jobs.fakecompat import (
    LayerDropDraws,
    as_real_step,
    cuda_autocast,
    cuda_kernels,
    no_weight_init,
    skips_all_ones_masks,
)
from gpuopt_tui.jobs.memprobe import build_model, loss_function, make_batch, make_optimizer, training_step
from gpuopt_tui.jobs.tracemem import (
    ACTIVATIONS,
    BATCH,
    CAST,
    OPTIMIZER,
    RECOMPUTE,
    WEIGHTS,
    Block,
    MemoryTrace,
    grad_relabeller,
    module_group,
)

STEPS = 2  # the first creates the optimizer state; the second runs as every later one does
TOP_MODULES = 12  # activations by module: the largest groups listed, the rest summed
# fake-tensor errors that name the op a model ran and fake tensors cannot (data-dependent values or shapes)
_FAKE_ERRORS = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)


def _module_label(path: str) -> str:
    """Where activations are listed: one level below a stack of layers ("model.layers.*.mlp"), else the path."""
    folded = module_group(path)
    head, star, tail = folded.partition(".*")
    if not star:
        return folded or "(outside any module: loss, masks)"
    first = tail.split(".")[1] if tail.startswith(".") else ""
    return head + star + ("." + first if first else "")


def _by_kind(blocks: list[Block]) -> dict[str, int]:
    sizes: dict[str, int] = defaultdict(int)
    for b in blocks:
        sizes[b.kind] += b.nbytes
    return dict(sizes)


def _by_module(blocks: list[Block]) -> list[tuple[str, int]]:
    sizes: dict[str, int] = defaultdict(int)
    for b in blocks:
        if b.kind in (ACTIVATIONS, CAST, RECOMPUTE):
            sizes[_module_label(b.module)] += b.nbytes
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1])
    rest = sum(n for _, n in ranked[TOP_MODULES:])
    return ranked[:TOP_MODULES] + ([("(other modules)", rest)] if rest else [])


def _where(error: BaseException) -> str:
    """The innermost frame of the model's own code (transformers or torch.nn), for a failure message."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "transformers" in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename.split('site-packages/')[-1]}:{f.lineno} ({f.name})"


def _failure(request: Mapping[str, Any], error: BaseException) -> str:
    model = str(request["config"].get("model_type", "?"))
    arch = ",".join(request["config"].get("architectures") or ()) or request["task"]
    if isinstance(error, _FAKE_ERRORS):
        op = getattr(error, "func", None)
        return (
            f"{model} ({arch}): the op {op} cannot run on fake tensors: its result depends on the data"
            f"{_where(error)}; use the closed form (where it covers {model}) or measure with --profile on a GPU"
        )
    return f"{model} ({arch}): tracing failed with {type(error).__name__}: {error}{_where(error)}"


def trace(request: Mapping[str, Any], say: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    """Trace `STEPS` training steps of the request's setup; peak allocated bytes and what made them up. `say` is
    told what the trace is doing as each part begins."""
    started = time.perf_counter()
    device = torch.device(request.get("trace_device", "cpu"))
    result: dict[str, Any] = {"micro_batch": int(request["micro_batch"]), "trace_device": str(device)}
    if int(request.get("n_gpus", 1)) > 1 or int(request.get("zero_stage", 0)) > 0:
        result["error"] = "the traced tier plans one GPU without ZeRO; use the closed form for several GPUs"
        return result
    amp_dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(request["precision"])
    memory = MemoryTrace()
    try:
        with FakeTensorMode(), as_real_step():
            say(f"building {request['config'].get('model_type', 'the model')} from its config on fake tensors")
            with no_weight_init():
                model = build_model(request, device)
            model.tie_weights()
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = make_optimizer(params, request, foreach=True)
            batch = make_batch(model, request, device)
            if model.config.model_type not in ENCODERS and skips_all_ones_masks(model):
                # all ones: a real step reads that and builds no mask; a fake one cannot read it and would
                del batch["attention_mask"]

            def phase(name: str) -> None:
                memory.phase = name
                say(f"step {memory.step} of {STEPS}: {name}")

            step = training_step(
                model, optimizer, None, loss_function(model, request), batch, request, amp_dtype, device, phase
            )
            unhook = grad_relabeller(memory, params)
            as_cuda = device.type == "cpu"  # the plan is for a GPU: CUDA's kernels and autocast lists
            kernels, autocast_lists = (cuda_kernels(), cuda_autocast()) if as_cuda else (nullcontext(), nullcontext())
            with memory, memory.watch(model), kernels, autocast_lists, LayerDropDraws():
                for t in (*model.parameters(), *model.buffers()):
                    memory.add(t, WEIGHTS)
                for t in batch.values():
                    memory.add(t, BATCH)
                for i in range(STEPS):
                    memory.step = i + 1
                    step()
                    for state in optimizer.state.values():
                        for value in state.values():
                            if isinstance(value, torch.Tensor):
                                memory.relabel(value, OPTIMIZER)
                memory.snapshot()
            unhook()
        result.update(
            params=sum(p.numel() for p in model.parameters()),
            trainable_params=sum(p.numel() for p in params),
            model_class=type(model).__name__,
            vocab=int(getattr(model.config, "vocab_size", 0) or 0),
        )
    except Exception as error:  # a model that cannot be traced is a result with a message, not a crash
        result["error"] = _failure(request, error)
        result["seconds"] = time.perf_counter() - started
        return result
    blocks = memory.peak_blocks
    result.update(
        max_allocated=memory.peak,
        peak_phase=memory.peak_phase,
        peak_step=memory.peak_step,
        peak_module=memory.peak_module,
        components=_by_kind(blocks),
        activations_by_module=_by_module(blocks),
        largest_block=max((b.nbytes for b in blocks), default=0),
        seconds=time.perf_counter() - started,
    )
    return result


def main() -> int:
    result = trace(json.loads(sys.stdin.read()), lambda message: print(PROGRESS + message, flush=True))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
