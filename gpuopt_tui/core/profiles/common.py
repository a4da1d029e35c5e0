"""Sections shared by every run kind: how to run, which model, which data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from gpuopt_tui.core.profiles.schema import Failure, opt
from gpuopt_tui.core.runs.distributed import check_scale

DEVICE_HELP = "Where to compute: auto (the GPU when there is one), cpu, cuda, or cuda:N"


@dataclass
class RunSection:
    device: str = opt("auto", DEVICE_HELP)
    seed: int = opt(0, "Random seed for sampling, projections and probe initialisation", min=0)

    def check(self, fail: Failure) -> None:
        dev = self.device
        if dev not in ("auto", "cpu", "cuda") and not (dev.startswith("cuda:") and dev[5:].isdigit()):
            fail("device", f'expected auto, cpu, cuda or cuda:N, got "{dev}"')


@dataclass
class ScaledRunSection(RunSection):
    """How to run a kind whose work can be sharded over several processes (torchrun)."""

    devices: str = opt(
        "1",
        'Processes: 1, a count N (GPUs 0..N-1; CPU processes if device = cpu), "all" GPUs, or a list like "0,2"',
        counts=True,
    )
    nodes: int = opt(1, "Machines taking part; each runs `gpuopt-tui join RUN` except this one", min=1, max=4096)
    rendezvous: str = opt("", "host:port every node can reach, for nodes > 1 (c10d rendezvous)")

    def check(self, fail: Failure) -> None:
        super().check(fail)
        check_scale(self, fail)


@dataclass
class ModelSection:
    adapter: str = opt(
        "demo",
        "demo: the built-in demo model; hf: a local Hugging Face model directory; plugin: your own factory",
        choices=("demo", "hf", "plugin"),
    )
    demo: str = opt(
        "classifier",
        "Which demo model (adapter = demo): a text classifier, a two-tower news recommender, or a causal language "
        "model (prompt -> completion)",
        choices=("classifier", "two_tower", "causal_lm"),
    )
    path: str = opt("", "Local model directory with config.json (adapter = hf); never downloaded")
    factory: str = opt("", "package.module:function returning an adapter (adapter = plugin)")

    def check(self, fail: Failure) -> None:
        if self.adapter == "hf" and not self.path:
            fail("path", "adapter = hf needs path = a local model directory (with config.json)")
        if self.adapter == "plugin" and ":" not in self.factory:
            fail("factory", 'adapter = plugin needs factory = "package.module:function"')


@dataclass
class DataSection:
    source: str = opt(
        "demo",
        "demo: the demo model's synthetic data; jsonl or csv: your file at path",
        choices=("demo", "jsonl", "csv"),
    )
    path: str = opt("", "Data file (source = jsonl or csv)")
    split: str = opt("test", "Demo split to use (source = demo)", choices=("train", "test"))
    text_field: str = opt("text", "Column or key holding the text")
    label_field: str = opt("label", "Column or key holding the integer label (may be absent)")
    max_length: int = opt(128, "Tokens per sample at most (longer texts are truncated)", min=2, max=8192)

    def check(self, fail: Failure) -> None:
        if self.source != "demo" and not self.path:
            fail("path", f"source = {self.source} needs path = the data file")


@dataclass
class ProfileBase:
    """Fields every profile has. Subclasses add `run`, `model`, `data` and their own section."""

    kind: ClassVar[str] = ""
    title: ClassVar[str] = ""
    name: str = opt("", "Short name shown in run lists (defaults to the file name)")
    description: str = opt("", "One line saying what this profile is for")
