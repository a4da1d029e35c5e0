"""A built demo model on disk: its manifest, checkpoints and data splits."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file, save_model
from torch import Tensor

from gpuopt_tui.core.errors import UserError
from gpuopt_tui.jobs.data import TextDataset
from gpuopt_tui.jobs.models.base import Checkpoint

SPLITS = ("train", "test")


@dataclass(frozen=True)
class DemoBundle:
    """A demo's cache directory. `manifest` holds the facts recorded at build time (accuracy, flipped
    train indices, signal tokens, training seconds, ...)."""

    kind: str
    root: Path
    manifest: dict[str, Any]
    built_now: bool

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def checkpoints(self) -> list[Checkpoint]:
        return [Checkpoint(self.root / c["file"], float(c["lr"])) for c in self.manifest["checkpoints"]]

    @property
    def flipped(self) -> list[int]:
        """Indices of train examples whose label was deliberately flipped."""
        return list(self.manifest.get("flipped", []))

    def dataset(self, split: str, token_fields: Mapping[str, str]) -> TextDataset:
        if split not in SPLITS:
            raise UserError(f'demo data split "{split}": expected one of {", ".join(SPLITS)}')
        prefix = f"{split}."
        tensors = {
            k[len(prefix) :]: v
            for k, v in load_file(str(self.root / "data.safetensors")).items()
            if k.startswith(prefix)
        }
        texts = json.loads((self.root / "data.json").read_text(encoding="utf-8"))[split]
        meta = {"flipped": self.flipped} if split == "train" else {}
        return TextDataset(tensors, texts, dict(token_fields), f"demo {self.kind}:{split}", meta)


def save_splits(root: Path, splits: Mapping[str, tuple[Mapping[str, Tensor], Sequence[Any]]]) -> None:
    """Write each split's tensors (data.safetensors, keys "split.name") and raw texts (data.json)."""
    tensors = {f"{split}.{k}": v.contiguous() for split, (ts, _) in splits.items() for k, v in ts.items()}
    save_file(tensors, str(root / "data.safetensors"))
    texts = {split: list(tx) for split, (_, tx) in splits.items()}
    (root / "data.json").write_text(json.dumps(texts), encoding="utf-8")


def save_model_dir(model: torch.nn.Module, model_dir: Path) -> None:
    """config.json and model.safetensors of a transformers model, loadable with `from_pretrained`. Written
    directly: `save_pretrained` writes nothing on ranks other than 0 of an initialised process group, and a
    demo model may be first built by any rank of a run over several processes."""
    model_dir.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]  # as save_pretrained records it: the hf adapter reads it
    model.config.save_pretrained(model_dir)
    save_model(model, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
