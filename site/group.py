"""The collectives the ranks of one site use to agree and to pass compressed chunks.

They run on the site's gloo control group (:func:`geodiloco.distributed.control_group`) with
CPU tensors, whatever device the model is on and whatever group the user started: outcomes,
join info and compressed bytes live on the host (see :mod:`geodiloco.distributed` for why).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from geodiloco.compression import EncodedChunk
from geodiloco.distributed import control_group, takes_cpu_tensors

T = TypeVar("T")
E = TypeVar("E", bound=IntEnum)


class SiteGroup:
    """The collectives the ranks of one site use to agree and to pass chunks (no-ops alone)."""

    def __init__(self, group: ProcessGroup | None = None) -> None:
        """``group``: a gloo group of the site's ranks (default: the control group, made now on
        every rank if the user's group cannot take CPU tensors)."""
        if group is not None and not takes_cpu_tensors(group):
            raise ValueError(
                f"group: its backend {dist.get_backend(group)!r} cannot take the CPU tensors of the "
                "site's control collectives; pass a gloo group, or none (geodiloco makes one)"
            )
        self.group = group if group is not None else control_group()
        initialized = dist.is_initialized()
        self.world = dist.get_world_size(self.group) if initialized else 1
        self.rank = dist.get_rank(self.group) if initialized else 0
        self.distributed = self.world > 1

    def _src(self, rank: int) -> int:
        """The global rank of group rank ``rank`` (collectives name their source globally)."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def agree(self, outcome: E) -> E:
        """The worst (largest) outcome of all ranks, on every rank."""
        if not self.distributed:
            return outcome
        t = torch.tensor([int(outcome)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return type(outcome)(int(t.item()))

    def broadcast(self, obj: T, src: int = 0) -> T:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self._src(src), group=self.group)
        return box[0]

    def gather(self, obj: T) -> list[T]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def sum(self, value: int) -> int:
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, group=self.group)
        return int(t.item())

    def sum_floats(self, values: Sequence[float]) -> list[float]:
        """Each of ``values`` summed over the ranks (float64, on the host)."""
        if not self.distributed:
            return [float(v) for v in values]
        t = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return [float(v) for v in t]

    def share_chunk(self, chunk: EncodedChunk | None, src: int) -> EncodedChunk:
        """The chunk rank ``src`` pulled, on every rank (compressed bytes, one chunk at a time)."""
        if not self.distributed:
            assert chunk is not None
            return chunk
        head = torch.zeros(3, dtype=torch.int64)
        if chunk is not None:
            head[:] = torch.tensor([chunk.start, chunk.numel, len(chunk.payload)])
        dist.broadcast(head, src=self._src(src), group=self.group)
        start, numel, size = (int(v) for v in head)
        body = torch.empty(size, dtype=torch.uint8)
        if chunk is not None and size:
            body.copy_(torch.frombuffer(bytearray(chunk.payload), dtype=torch.uint8))
        if size:
            dist.broadcast(body, src=self._src(src), group=self.group)
        return chunk if chunk is not None else EncodedChunk(start, numel, body.numpy().tobytes())
