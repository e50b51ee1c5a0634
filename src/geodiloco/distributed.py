"""Start and end a torchrun rank's process group, on the rank's own device.

Design: the default group is ``gloo`` on CPU and ``cpu:gloo,cuda:nccl`` on GPU, so the model's
collectives (DDP, FSDP2, TP, checkpoint reductions) run on NCCL with device tensors. A site's
control plane (agreement on push-again / resync, the join info, the pulled compressed chunks)
runs on a separate gloo group of CPU tensors: what it carries arrived from gRPC on the host and
goes to CPU decoders, so moving it to the GPU for NCCL would only add two copies. A CPU run asks
nothing of CUDA, not even whether it is there, when its device is ``cpu``.
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

DEVICES = ("auto", "cpu", "cuda")
_control: ProcessGroup | None = None


class DeviceError(ValueError):
    """A device this rank cannot use (no CUDA, fewer GPUs than local ranks)."""


@dataclass(frozen=True, slots=True)
class RankContext:
    """Who this rank is and where its tensors live."""

    rank: int
    world: int
    local_rank: int
    device: torch.device


def resolve_device(requested: str, local_rank: int) -> torch.device:
    """``cpu`` (never touches CUDA), ``cuda`` (GPU ``local_rank``, or an error), or ``auto``."""
    if requested not in DEVICES:
        raise DeviceError(f"device: {requested!r} is not one of {', '.join(DEVICES)}")
    if requested == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if requested == "cuda":
            raise DeviceError("device: cuda was asked for but torch sees no CUDA device")
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise DeviceError(f"device: local rank {local_rank} has no GPU of its own ({count} visible)")
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device) -> str:
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_rank(device: str = "auto", timeout_s: float = 3600) -> RankContext:
    """Join the group torchrun describes in the environment, on ``LOCAL_RANK``'s device, and
    make the site's gloo control group (see the module docstring)."""
    global _control
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    where = resolve_device(device, local_rank)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend_for(where), timeout=timeout)
    _control = dist.new_group(backend="gloo", timeout=timeout)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return RankContext(dist.get_rank(), dist.get_world_size(), local_rank, where)


def init_distributed(timeout_s: float = 3600, device: str = "auto") -> tuple[int, int]:
    """Join the group torchrun describes in the environment; returns (rank, world size)."""
    ctx = init_rank(device, timeout_s)
    return ctx.rank, ctx.world


def control_group() -> ProcessGroup | None:
    """The gloo group for CPU-side control collectives (None: the default group)."""
    return _control


def shutdown_distributed() -> None:
    """Leave together and tear the group down while the interpreter is fully alive: a rank that
    exits while gloo still holds work from DDP's reducer can abort in interpreter finalization."""
    global _control
    gc.collect()
    dist.barrier(group=_control)
    _control = None
    dist.destroy_process_group()
