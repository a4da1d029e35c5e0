"""Models a warm runner read before its run came (`gpuopt-tui warm --model DIR`, core/runs/warm.py).

A warm runner given model directories reads each one's weights with `from_pretrained`, on the CPU, as the loader
of a run on that directory would (the sequence-classification or causal-LM class its config names), and keeps
them. The run it takes then gets them from `read_model` instead of reading them again, once, and only while the
directory's files are as they were when read (names, sizes, modification times); otherwise it reads them as
always. What a run on another model, or a second run, gets is the usual read.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

Stamp = tuple[tuple[str, int, int], ...]

_kept: dict[tuple[str, str], tuple[Stamp, Any]] = {}  # (directory, class name) -> (its files' stamp, the model)


def read_model(path: Path, cls: Any, log: Callable[[str], None] = print, **kwargs: Any) -> Any:
    """`cls.from_pretrained(path, local_files_only=True, **kwargs)`, or the model a warm runner read from `path`
    with `cls` when the directory has not changed since (said through `log`)."""
    kept = _kept.pop((str(path.resolve()), cls.__name__), None)
    if kept is not None and kept[0] == _stamp(path):
        log(f"[info] {path}: the weights the warm runner read before the run (the files unchanged since)")
        return kept[1]
    return cls.from_pretrained(path, local_files_only=True, **kwargs)


def preload(path: Path) -> None:
    """Read the weights of the model directory `path` now, with the class its run's loader would use, and keep them
    for `read_model`."""
    from gpuopt_tui.jobs.models.causal_lm import is_causal_lm

    cls = _auto_class(is_causal_lm(path))
    model = cls.from_pretrained(path, local_files_only=True)
    _kept[(str(path.resolve()), cls.__name__)] = (_stamp(path), model)


def _auto_class(causal: bool) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return AutoModelForCausalLM if causal else AutoModelForSequenceClassification


def _stamp(path: Path) -> Stamp:
    files = sorted(p for p in path.iterdir() if p.is_file())
    return tuple((p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in files)
