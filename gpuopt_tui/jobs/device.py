"""Devices, mixed precision and GPU memory figures for the engines."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from gpuopt_tui.core.errors import UserError

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


def resolve_device(spec: str) -> torch.device:
    """The device for a profile's run.device: auto (the current GPU if any, else the CPU), cpu, cuda, cuda:N."""
    spec = spec.strip()
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else _cpu()
    if spec == "cpu":
        return _cpu()
    if spec == "cuda" or (spec.startswith("cuda:") and spec[5:].isdigit()):
        if not torch.cuda.is_available():
            raise UserError(f'device = "{spec}" but CUDA is not available here: {_why_no_cuda()}; use auto or cpu')
        index = int(spec[5:]) if ":" in spec else torch.cuda.current_device()
        count = torch.cuda.device_count()
        if index >= count:
            raise UserError(f'device = "{spec}" but this machine has {count} GPU(s): cuda:0..cuda:{count - 1}')
        return torch.device("cuda", index)
    raise UserError(f'device = "{spec}": expected auto, cpu, cuda or cuda:N')


def _why_no_cuda() -> str:
    if torch.version.cuda is None:
        return f"this torch {torch.__version__} is a CPU-only build"
    return f"this torch {torch.__version__} is built for CUDA {torch.version.cuda} but finds no GPU or no driver"


def start_cuda(spec: str) -> None:
    """Start CUDA on the device `spec` names (its driver and context) now, at a stage of its own: otherwise the
    first tensor on the GPU pays for it, inside whatever stage comes first."""
    device = resolve_device(spec)
    if device.type == "cuda":
        torch.zeros(1, device=device)
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> float:
    """Wall-clock seconds once the device's queued work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _cpu() -> torch.device:
    return torch.device("cpu")


def precision(use_amp: bool, amp_dtype: str, tf32: bool = False) -> str:
    """The precision name `autocast` takes, from the usual profile switches."""
    if use_amp:
        return amp_dtype
    return "tf32" if tf32 else "fp32"


@contextlib.contextmanager
def autocast(device: torch.device, precision: str) -> Iterator[None]:
    """Run the enclosed forward in `precision`: fp32, tf32 (fp32 storage, TF32 matmuls on the GPU), bf16 or
    fp16 autocast. On the CPU fp16 and tf32 do nothing (CPU fp16 autocast is slow and TF32 is GPU-only);
    bf16 uses CPU autocast. Wrap the forward only: take gradients and accumulate results outside, in fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if device.type == "cuda" and precision == "tf32":
        old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    elif precision == "bf16" or (precision == "fp16" and device.type == "cuda"):
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        with torch.autocast(device_type=device.type, dtype=dtype):
            yield
    else:
        yield


def amp_dtype_supported(device: torch.device, precision: str) -> bool:
    """False for bf16 on GPUs without bf16 support (pre-Ampere); engines can fall back to fp16 then."""
    if device.type != "cuda" or precision != "bf16":
        return True
    return torch.cuda.is_bf16_supported()


def is_oom(exc: BaseException) -> bool:
    """True for out-of-memory errors (CUDA caching allocator, cuBLAS allocation failures, host OOM)."""
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    message = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in message or "CUBLAS_STATUS_ALLOC_FAILED" in message)


def free_memory(device: torch.device) -> None:
    """Give cached blocks back to the driver (after an OOM, before retrying with a smaller chunk)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def cuda_memory_fields(device: torch.device | None = None) -> dict[str, Any]:
    """GPU memory figures for progress events: allocated, reserved and peak bytes; {} without CUDA."""
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return {}
    return {
        "gpu_allocated": torch.cuda.memory_allocated(device),
        "gpu_reserved": torch.cuda.memory_reserved(device),
        "gpu_peak": torch.cuda.max_memory_allocated(device),
    }
