"""Start and end a torchrun rank's process group (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import datetime
import gc
import os

import torch
import torch.distributed as dist


def init_distributed(timeout_s: float = 3600) -> tuple[int, int]:
    """Join the group torchrun describes in the environment; returns (rank, world size)."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return dist.get_rank(), dist.get_world_size()


def shutdown_distributed() -> None:
    """Leave together and tear the group down while the interpreter is fully alive: a rank that
    exits while gloo still holds work from DDP's reducer can abort in interpreter finalization."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
