"""The processes of a run started by torchrun, through torch.distributed.

The default process group uses NCCL on GPUs and gloo on the CPU. The engines exchange only small Python
objects (which batches are pending, timings) and files in the shared run directory, so those exchanges go
through a gloo group with a long timeout: ranks may wait hours for the slowest one at the final barrier, far
beyond NCCL's watchdog; a rank that dies is noticed by torchrun, which stops the others.
"""

from __future__ import annotations

import datetime
import os
from typing import TypeVar

import torch
import torch.distributed as dist

from gpuopt_tui.jobs.context import Collective

T = TypeVar("T")
CONTROL_TIMEOUT = datetime.timedelta(hours=48)


class TorchCollective(Collective):
    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def gather(self, obj: T) -> list[T] | None:
        out: list[T] | None = [obj] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def broadcast(self, obj: T) -> T:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def init_from_torchrun(use_cuda: bool) -> TorchCollective:
    """Join the process group torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR, ... in the environment)."""
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", timeout=CONTROL_TIMEOUT)
        return TorchCollective(dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT))
    dist.init_process_group("gloo", timeout=CONTROL_TIMEOUT)
    return TorchCollective(None)


def shutdown(collective: TorchCollective) -> None:
    """Leave the process group once every rank is done: a rank tearing its gloo connections down while another
    still uses them can abort that one ("terminate called without an active exception")."""
    if dist.is_initialized():
        collective.barrier()
        dist.destroy_process_group()
