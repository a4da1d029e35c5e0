"""Checkpoints loaded one after another, the next one read from disk while the current one is in use."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

from torch import Tensor

from gpuopt_tui.jobs.models.base import Adapter


class CheckpointLoader:
    """Loads `paths` into `adapter.model` in order, one per `load_next()`. With `prefetch`, a background
    thread reads the next file (`Adapter.read_weights`: disk to page-locked memory) as soon as the current
    one is loaded, so only `apply_weights` (queuing the copies to the GPU) stays on the caller's path. At most
    one state dict waits in memory besides the model's. A read that fails raises its error (the same
    UserError as `load_weights`) from the `load_next()` that needs it. Use as a context manager: leaving
    waits for a read in progress and drops one not yet started."""

    def __init__(self, adapter: Adapter, paths: Sequence[Path], *, prefetch: bool = True) -> None:
        self.adapter = adapter
        self.paths = list(paths)
        self.position = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tracin-prefetch") if prefetch else None
        self._next: Future[dict[str, Tensor]] | None = None

    def load_next(self) -> Path:
        """Load the next checkpoint into the model; returns its path."""
        path = self.paths[self.position]
        state = self._next.result() if self._next is not None else self.adapter.read_weights(path)
        self._next = None
        self.adapter.apply_weights(state, path)
        del state  # freed before the next read fills memory again
        self.position += 1
        if self._pool is not None and self.position < len(self.paths):
            self._next = self._pool.submit(self.adapter.read_weights, self.paths[self.position])
        return path

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._next = None

    def __enter__(self) -> CheckpointLoader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
