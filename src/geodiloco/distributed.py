"""Start and end a torchrun rank's process group, on the rank's own device.

Design: the default group is ``gloo`` on CPU and ``cpu:gloo,cuda:nccl`` on GPU, so the model's
collectives (DDP, FSDP2, TP, checkpoint reductions) run on NCCL with device tensors. A site's
control plane (agreement on push-again / resync, the join info, the pulled compressed chunks)
runs on a separate gloo group of CPU tensors: what it carries arrived from gRPC on the host and
goes to CPU decoders, so moving it to the GPU for NCCL would only add two copies. A CPU run asks
nothing of CUDA, not even whether it is there, when its device is ``cpu``.

A training loop of the user's own starts its group itself, with any backend (``nccl`` refuses
CPU tensors): :func:`control_group` then finds the default group fit for the control plane only
when it takes CPU tensors through gloo, and otherwise makes a gloo group over the same ranks,
once, when ``OuterSync.over`` asks for it on every rank. No CPU tensor of geodiloco's ever goes
through an NCCL group.
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
_control_beside: ProcessGroup | None = None  # the default group ``_control`` was made for


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
    make the site's gloo control group (see the module docstring). A group that the process's
    launcher made already is kept, whatever its backend."""
    global _control, _control_beside
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    where = resolve_device(device, local_rank)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend_for(where), timeout=timeout)
    _control = dist.new_group(backend="gloo", timeout=timeout)
    _control_beside = dist.group.WORLD
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return RankContext(dist.get_rank(), dist.get_world_size(), local_rank, where)


def init_distributed(timeout_s: float = 3600, device: str = "auto") -> tuple[int, int]:
    """Join the group torchrun describes in the environment; returns (rank, world size)."""
    ctx = init_rank(device, timeout_s)
    return ctx.rank, ctx.world


def takes_cpu_tensors(group: ProcessGroup | None = None) -> bool:
    """Whether ``group`` (default: the default group) passes CPU tensors to gloo: ``gloo``, or
    a ``cpu:gloo,...`` mapping. NCCL refuses them, and a backend geodiloco does not know is not
    trusted with them."""
    backend = str(dist.get_backend(group))
    by_device = dict(pair.split(":", 1) for pair in backend.split(",") if ":" in pair)
    return by_device.get("cpu", backend) == "gloo"


def control_group() -> ProcessGroup | None:
    """The group for CPU-side control collectives (None: the default group, or no group at all).

    :func:`init_rank`'s gloo group; else, in a group the user started, the default group if it
    :func:`takes_cpu_tensors`, or a gloo group over the same ranks made on the first call after
    the default group was (re)made. Making it is collective: call this on every rank, as
    ``OuterSync.over`` does."""
    global _control, _control_beside
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if _control is not None and _control_beside is world:
        return _control
    if takes_cpu_tensors():
        _control = None
        return None
    _control, _control_beside = dist.new_group(backend="gloo"), world
    return _control


def shutdown_distributed() -> None:
    """Leave together and tear the group down while the interpreter is fully alive: a rank that
    exits while gloo still holds work from DDP's reducer can abort in interpreter finalization."""
    global _control, _control_beside
    gc.collect()
    dist.barrier(group=control_group())
    _control = _control_beside = None
    dist.destroy_process_group()
