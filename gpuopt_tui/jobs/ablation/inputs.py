"""Where the per-layer representations come from, and their labels.

A `LayerSource` names its layers (in order), holds the labels (mapped to 0..C-1) and hands out, for each batch
of samples (batch j holds samples j * size .. (j + 1) * size - 1), one `MatrixBatch` per requested layer, for
every batch or for chosen ones (a process's share of them), with each batch's relative cost for balancing those
shares. It also gives each layer a content fingerprint, the input part of the feature cache's key. Sources:

- `model_source`: hidden states of every layer of a model over a data set (through the model adapter);
- `files_source`: a .safetensors file with one [N, ...] tensor per layer, or a folder of .pt/.npy files, one
  per layer (the file name is the layer name), with a ``labels`` tensor beside them;
- `lora_source`: the lora_A [N, r, in] / lora_B [N, out, r] tensors of a state dict, stacked over N adapters;
- `synthetic_source`: the generated set of synthetic.py.

Files are read lazily (memory-mapped where the format allows), a batch of rows at a time.
"""

from __future__ import annotations

import hashlib
import pickle
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from gpuopt_tui.core.caches.features import FeatureCache
from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.ablation.matrices import DenseBatch, LowRankProductBatch, MatrixBatch
from gpuopt_tui.jobs.ablation.synthetic import SyntheticSpec, generate
from gpuopt_tui.jobs.attention import padded_batch_kernels
from gpuopt_tui.jobs.context import ResumePart, StageFn, no_stage
from gpuopt_tui.jobs.data import trim_batch
from gpuopt_tui.jobs.digests import input_parts, tensor_digest
from gpuopt_tui.jobs.models.base import to_device

if TYPE_CHECKING:
    from gpuopt_tui.core.profiles.ablation import AblationProfile
    from gpuopt_tui.core.profiles.common import ModelSection
    from gpuopt_tui.jobs.data import TextDataset
    from gpuopt_tui.jobs.models.base import Adapter

LABELS = "labels"
TENSOR_SUFFIXES = (".pt", ".npy")
_LORA_KEY = re.compile(r"^(?P<layer>.+)\.lora_(?P<part>[AB])(?P<adapter>\.[^.]+)?\.weight$")


class LayerSource(ABC):
    def __init__(self, layers: list[str], labels: Tensor, where: str, description: str) -> None:
        self.layers = layers
        self.where, self.description = where, description
        self.class_values, self.labels = _class_indices(labels, where)

    @property
    def samples(self) -> int:
        return len(self.labels)

    @property
    def classes(self) -> int:
        return len(self.class_values)

    @abstractmethod
    def fingerprint(self, layer: str) -> str:
        """A hash of everything the layer's matrices are computed from (for the feature cache key)."""

    @abstractmethod
    def resume_parts(self, model: ModelSection, cache_dir: Path) -> dict[str, ResumePart]:
        """The resume record's parts that say what the layers and labels come from (see digests.py)."""

    def batch_bounds(self, batch_size: int) -> list[tuple[int, int]]:
        """(start, stop) sample indices of every batch."""
        return [(start, min(start + batch_size, self.samples)) for start in range(0, self.samples, batch_size)]

    def batch_costs(self, batch_size: int) -> list[float]:
        """The relative cost of each batch (to balance the processes' shares): its samples."""
        return [float(stop - start) for start, stop in self.batch_bounds(batch_size)]

    def batches(
        self, layers: Sequence[str], batch_size: int, device: torch.device, which: Iterable[int] | None = None
    ) -> Iterator[tuple[int, dict[str, MatrixBatch]]]:
        """(first sample index, {layer: matrices of the batch's samples}) for the batches numbered `which`
        (default: all of them), in that order."""
        bounds = self.batch_bounds(batch_size)
        for j in range(len(bounds)) if which is None else which:
            yield bounds[j][0], self._read(layers, *bounds[j], device)

    @abstractmethod
    def _read(self, layers: Sequence[str], start: int, stop: int, device: torch.device) -> dict[str, MatrixBatch]:
        """{layer: matrices of samples [start, stop)}."""


Reader = Callable[[int, int, torch.device], MatrixBatch]


class SlicedSource(LayerSource):
    """Layers that can be read a row range at a time (tensors in memory or in files)."""

    def __init__(
        self, readers: dict[str, Reader], fingerprints: dict[str, str], labels: Tensor, where: str, description: str
    ) -> None:
        super().__init__(list(readers), labels, where, description)
        self._readers, self._fingerprints = readers, fingerprints

    def fingerprint(self, layer: str) -> str:
        return self._fingerprints[layer]

    def resume_parts(self, model: ModelSection, cache_dir: Path) -> dict[str, ResumePart]:
        value = {"layers": self._fingerprints, "labels": tensor_digest(self.labels), "classes": self.class_values}
        return {"data": ResumePart(value, "the layers or labels", self.where)}

    def _read(self, layers: Sequence[str], start: int, stop: int, device: torch.device) -> dict[str, MatrixBatch]:
        return {layer: self._readers[layer](start, stop, device) for layer in layers}


# --- stored tensors ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StoredTensor:
    """A tensor in a file, read by row ranges. `where` names it in messages ("file" or "file: key")."""

    where: str
    shape: tuple[int, ...]
    dtype: str
    read: Callable[[int, int], Tensor]


def _safetensors(path: Path) -> dict[str, StoredTensor]:
    from safetensors import safe_open

    try:
        handle = safe_open(str(path), framework="pt")
        keys = list(handle.keys())
    except Exception as exc:
        raise UserError(f"{path}: not a readable safetensors file ({exc})") from exc

    def tensor(key: str) -> StoredTensor:
        view = handle.get_slice(key)
        return StoredTensor(f"{path}: {key}", tuple(view.get_shape()), str(view.get_dtype()), lambda a, b: view[a:b])

    return {key: tensor(key) for key in keys}


def _torch_file(path: Path) -> object:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):  # files in the legacy (non-zip) format cannot be memory-mapped
            raise _torch_file_error(path, exc) from exc
    except Exception as exc:
        raise _torch_file_error(path, exc) from exc
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise _torch_file_error(path, exc) from exc


def _torch_file_error(path: Path, exc: Exception) -> UserError:
    if isinstance(exc, pickle.UnpicklingError):
        return UserError(
            f"{path}: holds Python objects besides tensors, which loading with weights_only=True refuses "
            "(save plain tensors: torch.save(tensor, path))"
        )
    return UserError(f"{path}: cannot read the torch file with weights_only=True ({str(exc)[:200]})")


def _in_memory(where: str, t: Tensor) -> StoredTensor:
    return StoredTensor(where, tuple(t.shape), str(t.dtype).removeprefix("torch."), lambda a, b: t[a:b])


def _single_tensor(path: Path) -> StoredTensor:
    """A .npy or .pt file holding one tensor."""
    if path.suffix == ".npy":
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except Exception as exc:
            raise UserError(f"{path}: not a readable .npy array of numbers ({exc})") from exc
        if array.dtype.kind not in "biuf":
            raise UserError(f"{path}: expected an array of numbers, got dtype {array.dtype}")
        return StoredTensor(
            str(path), array.shape, str(array.dtype), lambda a, b: torch.from_numpy(np.array(array[a:b]))
        )
    value = _torch_file(path)
    if not isinstance(value, Tensor):
        raise UserError(f"{path}: expected one tensor, got {type(value).__name__}")
    return _in_memory(str(path), value)


def _state_dict(path: Path) -> dict[str, StoredTensor]:
    if path.suffix == ".safetensors":
        return _safetensors(path)
    value = _torch_file(path)
    if isinstance(value, dict) and isinstance(value.get("state_dict"), dict):
        value = value["state_dict"]
    if not isinstance(value, dict) or not all(isinstance(v, Tensor) for v in value.values()):
        raise UserError(f"{path}: expected a state dict (name -> tensor)")
    return {key: _in_memory(f"{path}: {key}", t) for key, t in value.items()}


def _is_numeric(dtype: str) -> bool:
    name = dtype.lower()
    return not any(bad in name for bad in ("complex", "c64", "c128", "bool", "str", "object"))


def _check_layer(t: StoredTensor, samples: int) -> None:
    if not _is_numeric(t.dtype):
        raise UserError(f"{t.where}: expected numbers, got dtype {t.dtype}")
    if len(t.shape) not in (2, 3):
        raise UserError(
            f"{t.where}: expected [N, features] or [N, rows, cols] (N = {samples} samples), got shape {list(t.shape)}"
        )
    if t.shape[0] < samples:
        raise UserError(f"{t.where}: has {t.shape[0]} samples, but the labels have {samples}")


def _read_labels(t: StoredTensor, n_samples: int) -> Tensor:
    if len(t.shape) != 1:
        raise UserError(f"{t.where}: labels must be one integer per sample [N], got shape {list(t.shape)}")
    n = t.shape[0] if n_samples <= 0 else min(n_samples, t.shape[0])
    labels = t.read(0, n)
    if labels.is_floating_point():
        if not torch.equal(labels, labels.round()):
            raise UserError(
                f"{t.where}: labels must be integer class indices, found {labels[labels != labels.round()][0]}"
            )
    elif labels.dtype in (torch.bool, torch.complex64, torch.complex128):
        raise UserError(f"{t.where}: labels must be integer class indices, got dtype {t.dtype}")
    return labels.long()


def _class_indices(labels: Tensor, where: str) -> tuple[list[int], Tensor]:
    values, indices = torch.unique(labels, return_inverse=True)
    if len(values) < 2:
        raise UserError(
            f"{where}: the {len(labels)} samples used all have label {values.tolist()}; probing needs two classes"
        )
    return [int(v) for v in values], indices


def _layer_order(name: str) -> list[object]:
    """Natural order: layer.2 before layer.10."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name)]


def _digest(*parts: str) -> str:
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def _dense_reader(t: StoredTensor) -> Reader:
    return lambda a, b, device: DenseBatch(t.read(a, b).to(device))


# --- sources -------------------------------------------------------------------------------------------------
def files_source(path: Path, labels_path: str, n_samples: int, cache: FeatureCache) -> SlicedSource:
    """Per-layer tensors from a .safetensors file or a folder of .pt/.npy files (see the module docstring)."""
    path = path.expanduser()
    if path.is_dir():
        files = sorted((p for p in path.iterdir() if p.suffix in TENSOR_SUFFIXES), key=lambda p: _layer_order(p.stem))
        layer_files = [p for p in files if p.stem != LABELS]
        if not layer_files:
            raise UserError(f"{path}: no .pt or .npy files in the folder (one per layer expected)")
        stems = [p.stem for p in layer_files]
        duplicate = next((stem for stem in stems if stems.count(stem) > 1), None)
        if duplicate is not None:
            raise UserError(f"{path}: layer {duplicate} is given twice (.pt and .npy)")
        tensors = {p.stem: _single_tensor(p) for p in layer_files}
        stored_labels = next((_single_tensor(p) for p in files if p.stem == LABELS), None)
        file_of = {p.stem: p for p in layer_files}
    elif path.suffix == ".safetensors" and path.is_file():
        tensors = _safetensors(path)
        stored_labels = tensors.pop(LABELS, None)
        tensors = {k: tensors[k] for k in sorted(tensors, key=_layer_order)}
        if not tensors:
            raise UserError(f"{path}: no layer tensors in the file (only labels)")
        file_of = dict.fromkeys(tensors, path)
    elif path.exists():
        raise UserError(f"{path}: expected a .safetensors file or a folder of .pt/.npy files")
    else:
        raise UserError(f"{path}: features_path not found")
    labels = _labels_for(path, labels_path, stored_labels, n_samples)
    n = len(labels)
    for t in tensors.values():
        _check_layer(t, n)
    fingerprints = {layer: _digest(cache.file_fingerprint(file_of[layer]), layer, str(n)) for layer in tensors}
    readers = {layer: _dense_reader(t) for layer, t in tensors.items()}
    return SlicedSource(readers, fingerprints, labels, str(path), f"{path}: {len(tensors)} layers, {n} samples")


def _labels_for(path: Path, labels_path: str, stored: StoredTensor | None, n_samples: int) -> Tensor:
    if labels_path:
        file = Path(labels_path).expanduser()
        if not file.is_file():
            raise UserError(f"{file}: labels_path not found")
        if file.suffix == ".safetensors":
            found = _safetensors(file)
            if LABELS not in found and len(found) != 1:
                raise UserError(f"{file}: expected a '{LABELS}' tensor (or a single tensor) in the file")
            stored = found.get(LABELS) or next(iter(found.values()))
        else:
            stored = _single_tensor(file)
    if stored is None:
        raise UserError(
            f"{path}: no labels: add a '{LABELS}' tensor (labels.npy / labels.pt in a folder) or set labels_path"
        )
    return _read_labels(stored, n_samples)


def lora_source(path: Path, labels_path: str, part: str, n_samples: int, cache: FeatureCache) -> SlicedSource:
    """The adapted layers of a LoRA state dict whose tensors carry N stacked adapters:
    ``<layer>.lora_A[.<adapter>].weight`` [N, r, in] and ``<layer>.lora_B[.<adapter>].weight`` [N, out, r].
    `part`: "product" probes B @ A (kept factored), "A" or "B" the factors themselves."""
    path = path.expanduser()
    if not path.is_file():
        raise UserError(f"{path}: features_path not found (a LoRA state dict file was expected)")
    state = _state_dict(path)
    pairs: dict[str, dict[str, StoredTensor]] = {}
    for key, t in state.items():
        match = _LORA_KEY.match(key)
        if match:
            layer = match["layer"] + (match["adapter"] or "")
            pairs.setdefault(layer, {})[match["part"]] = t
    if not pairs:
        raise UserError(f"{path}: no '<layer>.lora_A.weight' / '<layer>.lora_B.weight' tensors in the state dict")
    labels = _labels_for(path, labels_path, state.get(LABELS), n_samples)
    n = len(labels)
    readers: dict[str, Reader] = {}
    for layer in sorted(pairs, key=_layer_order):
        found = pairs[layer]
        if set(found) != {"A", "B"}:
            missing = ({"A", "B"} - set(found)).pop()
            raise UserError(f"{path}: {layer} has lora_{'B' if missing == 'A' else 'A'} but no lora_{missing}")
        a, b = found["A"], found["B"]
        for t in (a, b):
            if len(t.shape) != 3:
                raise UserError(
                    f"{t.where}: expected [N, rows, cols] with the N = {n} stacked adapters first, got shape "
                    f"{list(t.shape)} (a single adapter cannot be probed)"
                )
            _check_layer(t, n)
        if a.shape[1] != b.shape[2]:
            raise UserError(f"{b.where}: rank {b.shape[2]} does not match lora_A's rank {a.shape[1]}")
        readers[layer] = _lora_reader(a, b, part)
    file_fp = cache.file_fingerprint(path)
    fingerprints = {layer: _digest(file_fp, layer, part, str(n)) for layer in readers}
    return SlicedSource(
        readers, fingerprints, labels, str(path), f"{path}: {len(readers)} LoRA layers ({part}), {n} samples"
    )


def _lora_reader(a: StoredTensor, b: StoredTensor, part: str) -> Reader:
    if part == "A":
        return _dense_reader(a)
    if part == "B":
        return _dense_reader(b)
    return lambda lo, hi, device: LowRankProductBatch(b.read(lo, hi).to(device), a.read(lo, hi).to(device))


def synthetic_source(spec: SyntheticSpec) -> SlicedSource:
    layers, labels = generate(spec)
    fingerprints = {name: tensor_digest(t) for name, t in layers.items()}
    readers: dict[str, Reader] = {name: _dense_reader(_in_memory(name, t)) for name, t in layers.items()}
    description = (
        f"synthetic LoRA-like matrices: {spec.layers} layers of {spec.rank}x{spec.dim}, {spec.samples} samples, "
        f"{spec.classes} classes, label carried from layer {spec.signal_layer} on"
    )
    return SlicedSource(readers, fingerprints, labels, "synthetic data", description)


class ModelSource(LayerSource):
    """Hidden states of every layer of an adapter's model over a data set: ``embeddings`` (the embedding
    output) and ``layer.1`` .. ``layer.L`` (the outputs of the transformer blocks). A sample's matrix is its
    tokens x hidden, padding rows masked out; batches are trimmed to their longest sample."""

    def __init__(self, adapter: Adapter, dataset: TextDataset, note: str | None = None) -> None:
        if adapter.input_rank != 1:
            raise UserError(f"{adapter.name}: probing needs a single-sequence model (this one takes candidate lists)")
        if dataset.labels is None:
            raise UserError(f"{dataset.origin}: probing needs labels, but the data has none (set data.label_field)")
        self.adapter, self.dataset = adapter, dataset
        with torch.no_grad():
            count = len(adapter.hidden_states(to_device(dataset.batch([0]), adapter.device)))
        layers = ["embeddings", *(f"layer.{i}" for i in range(1, count))]
        description = f"{adapter.describe()}; {dataset.origin}" + (f"; {note}" if note else "")
        super().__init__(layers, dataset.labels, dataset.origin, description)
        self._fingerprint = ""

    def fingerprint(self, layer: str) -> str:
        if not self._fingerprint:  # weights and token ids: hashed once, only when the cache asks
            weights = list(self.adapter.model.state_dict().values())
            tokens = [self.dataset.tensors["input_ids"], self.dataset.tensors["attention_mask"]]
            self._fingerprint = tensor_digest(*weights, *tokens)
        return _digest(self._fingerprint, layer)

    def resume_parts(self, model: ModelSection, cache_dir: Path) -> dict[str, ResumePart]:
        return input_parts(model, self.adapter, [self.dataset], cache_dir)

    def batch_costs(self, batch_size: int) -> list[float]:
        """Tokens of each batch, padded to its longest sample (batches are trimmed to that length)."""
        lengths = self.dataset.lengths()
        return [float((stop - start) * int(lengths[start:stop].max())) for start, stop in self.batch_bounds(batch_size)]

    def _read(self, layers: Sequence[str], start: int, stop: int, device: torch.device) -> dict[str, MatrixBatch]:
        capacity = self.dataset.tensors["input_ids"].shape[-1]
        batch = trim_batch(self.dataset.batch(list(range(start, stop))), self.dataset.token_fields)
        batch = to_device(batch, self.adapter.device)
        with torch.no_grad(), padded_batch_kernels(batch["attention_mask"]):
            hidden = self.adapter.hidden_states(batch)
        mask = batch["attention_mask"].to(device)
        return {
            layer: DenseBatch(hidden[self.layers.index(layer)].to(device), mask, row_capacity=capacity)
            for layer in layers
        }


OPEN_STAGES = {
    "files": "opening the feature files",
    "lora": "opening the LoRA files",
    "synthetic": "generating the synthetic layers",
}


def model_source(
    profile: AblationProfile, device: torch.device, cache_dir: Path, stage: StageFn = no_stage
) -> ModelSource:
    from gpuopt_tui.jobs.data import cut_texts_note, load_dataset
    from gpuopt_tui.jobs.models import load_adapter

    adapter = load_adapter(profile.model, device, cache_dir, stage)
    dataset = load_dataset(profile.data, adapter, stage=stage).head(profile.ablation.n_samples)
    return ModelSource(adapter, dataset, cut_texts_note(dataset, profile.data, adapter))


def open_source(
    profile: AblationProfile, device: torch.device, cache: FeatureCache, cache_dir: Path, stage: StageFn = no_stage
) -> LayerSource:
    """The source a profile's [ablation] section names (`cache` fingerprints input files); `stage` hears what
    opening it does."""
    cfg = profile.ablation
    if cfg.source in OPEN_STAGES:  # a model source says its own stages
        stage(OPEN_STAGES[cfg.source])
    if cfg.source == "files":
        return files_source(Path(cfg.features_path), cfg.labels_path, cfg.n_samples, cache)
    if cfg.source == "lora":
        return lora_source(Path(cfg.features_path), cfg.labels_path, cfg.lora_part, cfg.n_samples, cache)
    if cfg.source == "synthetic":
        samples = cfg.n_samples or cfg.synthetic_samples
        spec = SyntheticSpec(
            samples=samples,
            layers=cfg.synthetic_layers,
            signal_layer=cfg.synthetic_signal_layer,
            rank=cfg.synthetic_rank,
            dim=cfg.synthetic_dim,
            classes=cfg.synthetic_classes,
            seed=profile.run.seed,
        )
        return synthetic_source(spec)
    return model_source(profile, device, cache_dir, stage)
