"""Runs over several processes: what torchrun is asked to start, from a profile's [run] section.

`devices` and `nodes` decide the processes. One process on one node is an ordinary run. Otherwise the run's
process supervises `torchrun` (a standalone rendezvous on one node, a c10d rendezvous at `rendezvous` for
several), whose workers run `python -m gpuopt_tui.jobs.worker RUN_DIR`; every other node joins with
`gpuopt-tui join RUN`, which starts the same torchrun command there. All nodes read and write the same run
directory, so it must be on a filesystem they share.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from gpuopt_tui.core.runs.processes import WORKER_MODULE, job_env

Failure = Callable[[str, str], NoReturn]  # as in profiles.schema: (key, message), raises

_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


@dataclass(frozen=True)
class Scale:
    """The processes of a run: `nproc` per node (a count, or "gpu" for every GPU), `visible` GPUs (a
    CUDA_VISIBLE_DEVICES list, "" for the default order), `nodes` and the `rendezvous` endpoint."""

    nproc: str = "1"
    visible: str = ""
    nodes: int = 1
    rendezvous: str = ""

    @property
    def distributed(self) -> bool:
        return self.nproc != "1" or self.nodes > 1

    def describe(self) -> str:
        per_node = "every GPU" if self.nproc == "gpu" else f"{self.nproc} process(es)"
        gpus = f" on GPUs {self.visible}" if self.visible else ""
        nodes = f" x {self.nodes} nodes (rendezvous {self.rendezvous})" if self.nodes > 1 else ""
        return f"{per_node}{gpus}{nodes}"


def parse_devices(devices: str) -> tuple[str, str]:
    """(torchrun's --nproc-per-node, CUDA_VISIBLE_DEVICES) for a `devices` value; ValueError says what is
    expected."""
    text = devices.strip().lower()
    if text == "all":
        return "gpu", ""
    if text.isdigit() and int(text) >= 1:
        return str(int(text)), ""
    items = [item.strip() for item in text.split(",")]
    if len(items) > 1 and all(item.isdigit() for item in items):
        if len(set(items)) != len(items):
            raise ValueError(f'"{devices}" names a GPU twice')
        return str(len(items)), ",".join(items)
    raise ValueError(f'expected a count such as 2, "all", or a GPU list such as "0,2"; got "{devices}"')


def check_scale(run: Any, fail: Failure) -> None:
    """Profile checks of a run section with `devices`, `nodes` and `rendezvous`."""
    try:
        nproc, visible = parse_devices(run.devices)
    except ValueError as e:
        fail("devices", str(e))
    if run.device == "cpu" and (nproc == "gpu" or visible):
        fail("devices", 'device = "cpu" runs CPU processes: give their count, e.g. devices = "2"')
    if run.device.startswith("cuda:") and (nproc != "1" or run.nodes > 1):
        fail("device", f'"{run.device}" picks one GPU; with several processes use device = "auto" or "cuda"')
    if run.nodes > 1 and not _HOST_PORT.match(run.rendezvous.strip()):
        fail("rendezvous", f'nodes = {run.nodes} needs rendezvous = "host:port" that every node can reach')


def scale_of(run: Any) -> Scale:
    """The Scale of a run section (plain RunSections, without `devices`, are one process)."""
    if not hasattr(run, "devices"):
        return Scale()
    nproc, visible = parse_devices(run.devices)
    return Scale(nproc, visible, run.nodes, run.rendezvous.strip())


def torchrun_command(run_dir: Path, scale: Scale, python: str = sys.executable) -> list[str]:
    """The torchrun command line that starts this node's workers of the run in `run_dir`."""
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", scale.nproc]
    if scale.nodes == 1:
        cmd.append("--standalone")
    else:
        cmd += ["--nnodes", str(scale.nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", scale.rendezvous]
        cmd += ["--rdzv-id", run_dir.name]
    return [*cmd, "-m", WORKER_MODULE, str(run_dir)]


def torchrun_env(scale: Scale, base: dict[str, str] | None = None) -> dict[str, str]:
    env = job_env(base)
    if scale.visible:
        env["CUDA_VISIBLE_DEVICES"] = scale.visible
    return env
