"""How many interpolation steps go into one forward/backward chunk.

A chunk holds whole steps for every sample of the batch, so its size is `steps x rows` forward rows of
`tokens` positions each. With "auto" on a GPU the first chunk is a probe: its peak memory (from
`torch.cuda.max_memory_allocated`) gives the cost of one row-token, and later chunks are sized to
`memory_fraction` of the free memory. On out-of-memory the chunk is halved and retried; the ceiling learned
that way stays for the rest of the run.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.event_hook import EventFn, EventReporter

CPU_ROW_TOKENS = 8192  # rows x tokens of one chunk on the CPU: large enough for BLAS, small in RAM
PROBE_ROW_TOKENS = 8192  # the GPU probe chunk (a few hundred MB on BERT-base)


class ChunkPlanner(EventReporter):
    """Chooses chunk sizes (in steps). `alpha_batch_size`: a fixed number of steps, "auto", or None (all
    steps in one chunk). Reuse one planner across batches so the GPU probe runs once."""

    def __init__(
        self,
        alpha_batch_size: int | Literal["auto"] | None = "auto",
        *,
        memory_fraction: float = 0.8,
        on_event: EventFn | None = None,
    ) -> None:
        if not (alpha_batch_size in (None, "auto") or (isinstance(alpha_batch_size, int) and alpha_batch_size > 0)):
            raise UserError(f'alpha_batch_size must be a positive integer or "auto", got {alpha_batch_size!r}')
        if not 0.0 < memory_fraction <= 1.0:
            raise UserError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        self.setting = alpha_batch_size
        self.memory_fraction = memory_fraction
        self.on_event = on_event
        self.bytes_per_row_token: float | None = None  # measured by the probe
        self.max_row_tokens: int | None = None  # ceiling learned from out-of-memory errors
        self._probe_base: int | None = None

    def next_steps(self, remaining: int, rows: int, tokens: int, device: torch.device) -> int:
        """Steps for the next chunk of a batch with `rows` samples of `tokens` positions each."""
        work = rows * tokens
        if isinstance(self.setting, int):
            steps = self.setting
        elif self.setting is None:
            steps = remaining
        elif device.type != "cuda":
            steps = CPU_ROW_TOKENS // work
        elif self.bytes_per_row_token is None:
            steps = PROBE_ROW_TOKENS // work
            torch.cuda.reset_peak_memory_stats(device)
            self._probe_base = torch.cuda.memory_allocated(device)
        else:
            steps = int(self._budget(device) / (self.bytes_per_row_token * work))
        if self.max_row_tokens is not None:
            steps = min(steps, self.max_row_tokens // work)
        steps = max(1, min(steps, remaining))
        # Same number of chunks, sizes as even as possible (no small last chunk).
        return math.ceil(remaining / math.ceil(remaining / steps))

    def chunk_done(self, steps: int, rows: int, tokens: int, device: torch.device) -> None:
        """Record a finished chunk; after the probe, this fixes the memory cost per row-token."""
        if self._probe_base is None:
            return
        peak = torch.cuda.max_memory_allocated(device) - self._probe_base
        self._probe_base = None
        self.bytes_per_row_token = max(peak, 1) / (steps * rows * tokens)
        self._emit(
            "chunk_probe",
            steps=steps,
            rows=rows,
            tokens=tokens,
            peak_bytes=peak,
            bytes_per_row_token=self.bytes_per_row_token,
            budget_bytes=self._budget(device),
        )

    def shrink(self, steps: int, rows: int, tokens: int) -> bool:
        """After an out-of-memory error in a chunk of `steps`: halve the ceiling. False when already 1 step."""
        self._probe_base = None
        if steps <= 1:
            return False
        self.max_row_tokens = (steps // 2) * rows * tokens
        self._emit("oom_retry", steps=steps, retry_steps=steps // 2, rows=rows, tokens=tokens)
        return True

    def _budget(self, device: torch.device) -> float:
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return self.memory_fraction * (free + cached)
