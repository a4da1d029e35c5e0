"""One block of cached training gradients as a file: a safetensors file whose metadata says what the block was
computed from (its identity: the entry's key, which covers the checkpoint's content, the training data and the
gradient settings, shown again in readable fields, and the block's number) and a checksum of that identity with
every tensor's name, dtype, shape and bytes. A block is used only when all of it checks out; anything else (a
damaged, truncated or foreign file, one of another block, checkpoint or layout) is a problem, said in words.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import Tensor

from gpuopt_tui.core.caches.files import digest_chunks, split

STORED = torch.bfloat16
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64, "I64": torch.int64}
CHECKSUM = "checksum"
SELF_DOT = "self_dot"  # <Γ(g), g> of Adam-preconditioned gradients
# what each identity field names, for the message when a block's differs from the run's
IDENTITY_WORDS = {
    "format": "cache format",
    "entry": "checkpoint, training set or gradient settings",
    "block": "block of training examples",
    "checkpoint": "checkpoint",
    "train": "training set",
    "projection": "projection (size or seed)",
    "bases": "set of projection directions (fitted again since)",
}

HostBlock = dict[str, Tensor]


def checksum(identity: Mapping[str, str], tensors: Mapping[str, Tensor]) -> str:
    names = sorted(tensors)
    layout = {name: [str(tensors[name].dtype), list(tensors[name].shape)] for name in names}
    head = json.dumps([dict(identity), layout], sort_keys=True).encode()
    return digest_chunks(itertools.chain([head], *(split(_bytes(tensors[name])) for name in names)))


def _bytes(t: Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def write_block(path: Path, identity: Mapping[str, str], tensors: Mapping[str, Tensor]) -> None:
    """Save `tensors` (contiguous, on the CPU) to `path` with their identity and checksum; raises OSError when
    the file cannot be written."""
    metadata = {**identity, CHECKSUM: checksum(identity, tensors)}
    try:
        save_file(dict(tensors), str(path), metadata=metadata)
    except SafetensorError as e:  # how safetensors reports a folder it cannot write in, or a full disk
        raise OSError(str(e)) from e


def read_block(
    path: Path, identity: Mapping[str, str], rows: Sequence[int], pin: bool
) -> tuple[HostBlock | None, str | None]:
    """(the block's tensors, None) when the file at `path` is the block of `identity` for `rows`, intact;
    (None, what is wrong) when it is damaged or not this block; (None, None) when there is no such file, or when
    it is an intact block of other rows (written by a run that cut the training set into other blocks)."""
    tensors, problem = read_checked(path, identity, pin)
    if tensors is None:
        return None, problem
    problem = _layout_problem(tensors)
    if problem is not None:
        return None, problem
    return (tensors, None) if tensors["rows"].tolist() == list(rows) else (None, None)


def read_checked(path: Path, identity: Mapping[str, str], pin: bool) -> tuple[HostBlock | None, str | None]:
    """(the file's tensors, None) when the file at `path` was written by `write_block` for `identity` and is
    intact; (None, what is wrong) otherwise; (None, None) when there is no such file."""
    if not path.is_file():
        return None, None
    try:
        tensors, metadata = read_safetensors(path, pin)
    except (OSError, ValueError, RecursionError) as e:
        return None, f"unreadable ({e})"
    if not set(identity) | {CHECKSUM} <= set(metadata):
        return None, "it does not say what it was computed from"
    wrong = next((key for key, value in identity.items() if metadata[key] != value), None)
    if wrong is not None:
        return None, f"it was computed for another {IDENTITY_WORDS.get(wrong, wrong)}"
    if metadata[CHECKSUM] != checksum(identity, tensors):
        return None, "its content does not match its checksum"
    return tensors, None


def _layout_problem(tensors: Mapping[str, Tensor]) -> str | None:
    """None when `tensors` are laid out as `CheckpointGradients.save` writes a block, else what differs."""
    stored = tensors.get("rows")
    if stored is None or stored.dtype != torch.int64 or stored.dim() != 1:
        return "it has no row numbers"
    rows = stored.tolist()
    pairs = sum(1 for name in tensors if name.startswith("g"))
    expected = {"rows", "dense"} | {f"{side}{i}" for i in range(pairs) for side in "ga"}
    expected |= {SELF_DOT} & set(tensors)  # preconditioned gradients only: one number per row
    if set(tensors) != expected:
        return f"it holds tensors {sorted(tensors)}, not {sorted(expected)}"
    for name, t in tensors.items():
        dims = 1 if name == SELF_DOT else 2
        if name != "rows" and (t.dtype != STORED or t.dim() != dims or t.shape[0] != len(rows)):
            return f"its {name} is {t.dtype} {list(t.shape)}, not {STORED} with {len(rows)} rows"
    return None


def read_safetensors(path: Path, pin: bool) -> tuple[HostBlock, dict[str, str]]:
    """The tensors of a safetensors file and its metadata, the tensors read with one copy into host memory
    (page-locked when `pin`, so that copies to the GPU need no staging). The header is checked against the
    file's size before anything is allocated; raises ValueError (or OSError) on a damaged file."""
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or n > size - 8:
            raise ValueError("its header runs past the end of the file")
        header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise ValueError("its metadata is not a JSON object")
        data_size = size - 8 - n
        specs = {name: _spec(name, spec, data_size) for name, spec in header.items()}
        data = torch.empty(data_size, dtype=torch.uint8, pin_memory=pin)
        if f.readinto(memoryview(data.numpy())) != data_size:
            raise ValueError("shorter than its header says")
    tensors = {name: data[begin:end].view(dtype).reshape(shape) for name, (dtype, shape, begin, end) in specs.items()}
    return tensors, metadata


def _spec(name: str, spec: object, data_size: int) -> tuple[torch.dtype, list[int], int, int]:
    """(dtype, shape, begin, end) of a header entry, checked: a known dtype, a shape whose size is the entry's
    bytes, offsets inside the data and aligned to the dtype."""
    try:
        dtype = _DTYPES[spec["dtype"]]  # type: ignore[index]
        shape, (begin, end) = list(spec["shape"]), spec["data_offsets"]  # type: ignore[index]
    except (TypeError, KeyError, ValueError) as e:
        raise ValueError(f"tensor {name!r}: malformed header entry") from e
    numbers = [*shape, begin, end]
    if not all(type(x) is int and x >= 0 for x in numbers):
        raise ValueError(f"tensor {name!r}: shape and offsets must be whole numbers")
    item = torch.empty(0, dtype=dtype).element_size()
    if not begin <= end <= data_size or begin % item or end - begin != math.prod(shape) * item:
        raise ValueError(f"tensor {name!r}: shape {shape} and offsets {[begin, end]} do not fit the file")
    return dtype, shape, begin, end
