"""Digests of what a run's shards are made from: the tokenized data, the model's weights and its tokenizer.

Every kind's resume record keeps them (`input_parts`, checked by JobContext.check_resume_record), so that shards
made from other data, weights or vocabulary are never mixed with new ones. Weight files are hashed whole (SHA-256
of their bytes), each remembered in the cache directory by its size, times and inode (see
core.caches.features.remembered_digest), so that a rerun on an unchanged multi-GB model reads nothing again; a
model known only in memory (a plugin's) is hashed from its state dict.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gpuopt_tui.core.caches.features import remembered_digest
from gpuopt_tui.core.profiles.common import ModelSection
from gpuopt_tui.jobs.context import ResumePart
from gpuopt_tui.jobs.data import TextDataset
from gpuopt_tui.jobs.models.base import Adapter

FILE_DIGESTS = "file-digests.json"  # in the cache directory: the memo of remembered_digest
# What from_pretrained reads of a model directory besides the tokenizer (optimizer states and the like are not)
WEIGHT_FILES = (
    "config.json",
    "adapter_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model*.bin.index.json",
    "adapter_model.bin",
)


def _raw_bytes(t: Tensor) -> memoryview:
    """The tensor's bytes in memory order (a CPU copy only where it lives elsewhere or is not contiguous)."""
    return memoryview(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy())


def tensor_digest(*tensors: Tensor) -> str:
    """SHA-256 of the tensors' shapes, dtypes and values."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(str((tuple(t.shape), t.dtype)).encode())
        digest.update(_raw_bytes(t))
    return digest.hexdigest()


def dataset_digest(*datasets: TextDataset) -> str:
    """SHA-256 of the datasets' tensors (token ids, masks, labels, ...), each key with its values."""
    digest = hashlib.sha256()
    for ds in datasets:
        for key in sorted(ds.tensors):
            digest.update(key.encode())
            digest.update(_raw_bytes(ds.tensors[key]))
    return digest.hexdigest()


def file_digest(path: Path, cache_dir: Path) -> str:
    """SHA-256 of a file's bytes, remembered in `cache_dir` while the file stays as it is."""
    return remembered_digest(path, cache_dir / FILE_DIGESTS)


def weights_digest(adapter: Adapter, cache_dir: Path) -> str:
    """The model's weight files (with its config) where the adapter read them from a directory, else its state
    dict as it is in memory."""
    folder = adapter.weights_dir
    files = sorted({p for pattern in WEIGHT_FILES for p in folder.glob(pattern)} if folder else set())
    if not any(p.name not in ("config.json", "adapter_config.json") for p in files):
        state = adapter.model.state_dict()
        return hashlib.sha256(f"{list(state)}{tensor_digest(*state.values())}".encode()).hexdigest()
    named = [(p.name, file_digest(p, cache_dir)) for p in files]
    return hashlib.sha256(json.dumps(named).encode()).hexdigest()


def tokenizer_digest(tokenizer: Any) -> str:
    """The tokenizer's full description where it has one (a fast tokenizer's JSON), else its vocabulary; with
    its special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        described: Any = backend.to_str()
    elif callable(getattr(tokenizer, "get_vocab", None)):
        described = sorted(tokenizer.get_vocab().items())
    else:
        described = type(tokenizer).__qualname__
    special = getattr(tokenizer, "special_tokens_map", {})
    text = json.dumps([type(tokenizer).__qualname__, described, special], default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def model_origin(model: ModelSection) -> str:
    """The profile key that names where the model comes from, with its value."""
    if model.adapter == "hf":
        return f"model.path {model.path}"
    if model.adapter == "plugin":
        return f"model.factory {model.factory}"
    return f"model.demo {model.demo}"


def input_parts(
    model: ModelSection, adapter: Adapter, datasets: Sequence[TextDataset], cache_dir: Path
) -> dict[str, ResumePart]:
    """The resume record's parts for a run over `datasets` with the adapter's model and tokenizer."""
    origin = model_origin(model)
    return {
        "data": ResumePart(dataset_digest(*datasets), "the data", ", ".join(dict.fromkeys(d.origin for d in datasets))),
        "model": ResumePart(weights_digest(adapter, cache_dir), "the model weights", origin),
        "tokenizer": ResumePart(tokenizer_digest(adapter.tokenizer), "the tokenizer", origin),
    }
