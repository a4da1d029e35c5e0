"""The traced tier: the user's model class and training step run on fake tensors (no GPU, no weights), in a child
process (`python -m gpuopt_tui.jobs.plantrace`), and its peak turned into the planner's figures.

What the trace sees: every tensor the step makes, with its module and phase, over two steps of the setup's loop
(the first creates the optimizer state), so its peak allocated is torch's `max_memory_allocated()` of that step
on the device it emulates. What it cannot see is estimated as the closed form estimates it (`Overheads`):
- the CUDA context and loaded kernels (outside torch's allocator),
- cuBLAS workspaces (inside kernels, never tensors),
- the caching allocator's reserved-but-unallocated memory: `Overheads.allocator`, plus `TRACED_LM_SLACK` per
  token and vocabulary entry when the peak is at an LM loss (its fp32 logits alive at the peak),
- NCCL buffers and several GPUs (the trace plans one GPU: several GPUs or ZeRO are refused).
Fake tensors live on the CPU where torch has no CUDA: the CPU's fused attention stands in for CUDA's (both keep
their output and log-sum-exp), dropout and attention dropout run as CUDA's kernels do, and autocast follows CUDA's
op lists (an op CUDA runs in fp32, such as the pow of GPT-2's and Phi's GELU, is not left in 16 bits as the CPU's
lists leave it; `jobs/fakecompat.py`): the CPU's trace comes within 512 bytes of the trace on fake CUDA tensors
that benchmarks/results/planner_traced_H200.json holds for six families.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.core.format import human_bytes
from gpuopt_tui.core.planner.estimate import Component, Overheads
from gpuopt_tui.core.planner.train_setup import TrainSetup

TRACE_MODULE = "gpuopt_tui.jobs.plantrace"
PROGRESS = "progress: "  # how the child's progress lines start (jobs/plantrace.py writes them)
TIER = "traced on fake tensors (no GPU)"
TRACED = "traced"  # the tier's name on a recommendation
# The share of the budget a traced search keeps back: the CPU's kernels standing in for CUDA's, and the allocator
# model's error (the closed form's figure, until GPU runs of benchmarks/planner_traced.py measure the trace's own)
TRACED_HEADROOM = 0.05
# Beyond this share of the traced peak, and this many bytes, the closed form's difference is flagged: below the
# bytes, the difference is the closed form's fixed allocator constant on a small model, not a disagreement
LARGE_DIFFERENCE = 0.10
LARGE_DIFFERENCE_BYTES = 512 * 1024**2
# trace component key -> (row key for the colours, label, how)
ROWS = (
    ("weights", "weights", "Weights", "every parameter and buffer of the built model"),
    ("gradients", "gradients", "Gradients", "accumulated gradients alive at the peak"),
    ("optimizer", "optimizer", "Optimizer state", "the optimizer's state tensors after its first step"),
    ("cast_cache", "cast_cache", "16-bit weight copies (autocast)", "casts of weights made in the forward pass"),
    ("activations", "activations", "Activations", ""),
    ("recompute", "recompute", "Recomputed activations", "module forwards run again in backward (checkpointing)"),
    ("temporaries", "working", "Temporaries", "backward and optimizer buffers that are no gradient or state"),
    ("batch", "batch", "Batch", "input ids, mask, labels"),
)


@dataclass(frozen=True)
class TracedEstimate:
    """Peak memory of one training step on one GPU as the trace saw it, by component (like `Estimate`)."""

    components: tuple[Component, ...]
    phase: str  # the phase of the step where the peak was: forward, backward or optimizer step
    allocated: int
    reserved: int
    total: int
    params: int
    trainable_params: int
    model_class: str
    modules: tuple[tuple[str, int], ...]  # activations at the peak by module (layers folded), largest first
    seconds: float
    tier: str = TIER


def run_trace(
    request: Mapping[str, Any],
    log: Callable[[str], None] = lambda message: None,
    timeout: float = 600.0,
    python: str = sys.executable,
) -> dict[str, Any]:
    """Trace one training step in a child process, passing its progress lines to `log`; its result, or UserError
    naming the model and why."""
    model = str(request["config"].get("model_type", "model"))
    with subprocess.Popen(
        [python, "-m", TRACE_MODULE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one pipe: warnings and a traceback come in order, and cannot block the child
        text=True,
        # TorchScript functions in model code (DeBERTa-v2's relative positions, transformers 5.17) cannot run on
        # fake tensors; PYTORCH_JIT=0 leaves them plain Python, whose memory is the same
        env={**os.environ, "PYTORCH_JIT": "0"},
    ) as child:
        stop = threading.Timer(timeout, child.kill)
        stop.start()
        try:
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write(json.dumps(request))
            child.stdin.close()
            lines = []
            for line in child.stdout:
                if line.startswith(PROGRESS):
                    log(line[len(PROGRESS) :].strip())
                else:
                    lines.append(line)
            code = child.wait()
        finally:
            stop.cancel()
    results = [line for line in lines if line.startswith("{")]
    if not results:
        if code < 0:
            raise UserError(f"tracing the {model} step took longer than {timeout:.0f} s (stopped)")
        tail = " | ".join("".join(lines).strip().splitlines()[-3:])
        raise UserError(f"tracing the {model} step failed (exit code {code}): {tail}")
    result = json.loads(results[-1])
    if result.get("error"):
        raise UserError(f"traced tier: {result['error']}")
    return result


# Reserved but unallocated bytes per token and vocabulary entry around an LM loss, over the traced peak: calibrated
# on the H200 against 12 measured steps (benchmarks/results/planner_traced_H200.md), where full fine-tunes needed
# 1.3-1.9 (with `Overheads.allocator`) and LoRA ones 1.7-3.6. Lower than the closed form's LM_RESERVED_SLACK (4 B
# when the head trains): the trace counts the loss's temporaries that the closed form's constant also stands for.
TRACED_LM_SLACK = {"head trains": 2.5, "head frozen": 2.0}

# Reserved but unallocated bytes beside any traced peak, as a share of it: fitted on 15 runs of the HF Trainer, 8
# families at a recommended and a small micro-batch on an H200 (benchmarks/results/planner_retrace_cpu.md), where
# the measured gap was 0.3-5.4% of the peak allocated, the LM slack aside. The closed form's fixed 300 MiB
# (`Overheads.allocator`) also stands for tensors it does not count, which the trace does: at footprints of 1.6-3 GiB
# it put the trace's reserved figure 11-18% over the Trainer's.
TRACED_FRAGMENTATION = 0.01

TRACE_LIMITS = (
    "Not traced: the CUDA context and cuBLAS workspaces (the closed form's figures) and the allocator's slack "
    f"({TRACED_FRAGMENTATION:.0%} of the traced peak, with an LM loss's share). Fake tensors stand in for CUDA with "
    "CUDA's autocast lists and the CPU's attention kernels."
)


def _lm_slack(result: Mapping[str, Any], task: str, setup: TrainSetup) -> int:
    """The LM loss's reserved-but-unallocated slack, when the peak holds the loss's fp32 logits."""
    cells = setup.tokens * int(result.get("vocab") or 0)
    if task not in ("causal_lm", "masked_lm") or not cells or int(result.get("largest_block", 0)) < 4 * cells:
        return 0
    return int(TRACED_LM_SLACK["head trains" if setup.trainable == "all" else "head frozen"] * cells)


def traced_estimate(
    result: Mapping[str, Any], task: str, setup: TrainSetup, overheads: Overheads | None = None
) -> TracedEstimate:
    """The planner's figures from a trace result: reserved and total by the allocator model the closed form uses."""
    oh = overheads or Overheads()
    parts: Mapping[str, int] = result["components"]
    modules = tuple((str(name), int(n)) for name, n in result.get("activations_by_module", ()))
    top = ", ".join(f"{name} {human_bytes(n)}" for name, n in modules[:3])
    rows = [
        Component(key, label, int(parts.get(part, 0)), True, how or f"saved for backward, by module: {top}")
        for part, key, label, how in ROWS
        if parts.get(part)
    ]
    slack = _lm_slack(result, task, setup)
    allocated = int(result["max_allocated"])
    allocator = int(allocated * TRACED_FRAGMENTATION) + slack
    reserved = allocated + allocator + oh.workspaces
    rows += [
        Component("workspaces", "cuBLAS workspaces", oh.workspaces, True, "not tensors: the closed form's figure"),
        Component(
            "allocator",
            "Allocator slack",
            allocator,
            True,
            f"reserved but unallocated: {TRACED_FRAGMENTATION:.0%} of the peak allocated, as measured"
            + (", with the LM loss's share (the peak is at the loss)" if slack else ""),
        ),
        Component("context", "CUDA context", oh.context, True, "outside torch's allocator; probes measure it"),
    ]
    return TracedEstimate(
        components=tuple(rows),
        phase=f"{result['peak_phase']} of step {result['peak_step']}",
        allocated=allocated,
        reserved=reserved,
        total=reserved + oh.context,
        params=int(result["params"]),
        trainable_params=int(result["trainable_params"]),
        model_class=str(result.get("model_class", "")),
        modules=modules,
        seconds=float(result.get("seconds", 0.0)),
    )


def difference(closed: int, traced: int) -> str:
    """The closed form against the trace, as a signed share of the trace ("flag" when it is large)."""
    share = closed / traced - 1
    large = abs(share) > LARGE_DIFFERENCE and abs(closed - traced) > LARGE_DIFFERENCE_BYTES
    return f"{share:+.1%}" + (" (large)" if large else "")
