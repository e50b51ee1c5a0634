"""``strictnccl``: a stand-in for NCCL, because no GPU is here to run NCCL itself.

NCCL refuses CPU tensors ("Tensors must be CUDA and dense"), so a CPU tensor that a training
loop or geodiloco hands to a collective of a user's ``init_process_group("nccl")`` group fails
on the first GPU cluster it meets. This backend is gloo underneath, and refuses such tensors as
NCCL would, so a CPU-only test catches them.

What counts as such a tensor. Here the model itself is on the CPU, standing in for the GPU, so
the device alone cannot tell a model tensor from a host one. The stand-in tells them by who
asked: a collective called through ``torch.distributed``'s functions by code outside torch
(the user's loop, geodiloco) with a CPU tensor is refused; the collectives torch's own parallel
code issues for the model (DDP's reducer, FSDP2, DTensor, checkpoint helpers) pass, since on a
GPU their tensors are on the device, and torch moves its object collectives there for NCCL.
One blind spot, on purpose: a collective that geodiloco issues itself on model tensors (a
pipeline stage's loss, experts' tokens, a checkpoint's residual) is refused here though it
would be a device tensor on a GPU; the tests that use this backend train with DDP and FSDP2.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

NAME = "strictnccl"
_TORCH = os.path.dirname(torch.__file__) + os.sep
_API = {  # torch.distributed's functions and their wrappers: the caller is whoever called them
    os.path.join(_TORCH, "distributed", "distributed_c10d.py"),
    os.path.join(_TORCH, "distributed", "c10d_logger.py"),
}
# every collective a ProcessGroup serves; each is checked, then done by gloo
COLLECTIVES = (
    "allreduce",
    "allreduce_coalesced",
    "broadcast",
    "allgather",
    "_allgather_base",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "gather",
    "scatter",
    "reduce",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced",
    "alltoall",
    "alltoall_base",
    "send",
    "recv",
    "recv_anysource",
    "barrier",
)


class CpuTensorRefused(RuntimeError):
    """What NCCL would raise for a CPU tensor, naming the code that passed it."""


def _caller() -> str:
    """The file that asked for the collective in progress (outside this module and torch's API)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename == __file__ or frame.f_code.co_filename in _API):
        frame = frame.f_back
    return frame.f_code.co_filename if frame is not None else "?"


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


class StrictNccl(ProcessGroup):
    """A process group that does gloo's work but refuses, as NCCL does, the CPU tensors a
    caller outside torch passes to it (see the module docstring)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stubs know the store's form only
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore(NAME, store), rank, size, timeout)
        # torch's own collective ops (DTensor, FSDP2) reach a group's backend for the tensors'
        # device directly: they are torch's, so gloo serves them unchecked
        self._register_backend(torch.device("cpu"), ProcessGroup.BackendType.CUSTOM, self.gloo)

    def getBackendName(self) -> str:
        return NAME

    def check(self, collective: str, args: tuple[Any, ...]) -> None:
        caller = _caller()
        if caller.startswith(_TORCH):
            return
        if any(t.device.type == "cpu" for t in _tensors(args)):
            raise CpuTensorRefused(
                f"{NAME} (a stand-in for NCCL): Tensors must be CUDA and dense; {collective} was "
                f"given a CPU tensor by {caller}"
            )


def _checked(collective: str) -> Callable[..., Any]:
    def run(self: StrictNccl, *args: Any, **kwargs: Any) -> Any:
        self.check(collective, (*args, *kwargs.values()))
        return getattr(self.gloo, collective)(*args, **kwargs)

    run.__name__ = collective
    return run


for _collective in COLLECTIVES:
    setattr(StrictNccl, _collective, _checked(_collective))


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> StrictNccl:
    return StrictNccl(store, rank, size, timeout)


def register() -> None:
    """Make ``init_process_group("strictnccl")`` available in this process (idempotent)."""
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])


def init_default_group() -> None:
    """The user's ``init_process_group("strictnccl")``, from torchrun's environment variables."""
    register()
    dist.init_process_group(NAME)
