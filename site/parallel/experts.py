"""Expert parallelism: a site's ranks split the experts of every mixture-of-experts layer.

With ``ep`` = N, the data-parallel ranks form groups of N; in each group, rank i holds experts
``[i*E/N, (i+1)*E/N)`` of every layer, and the rest of the model is replicated (DDP). Every rank
trains on its own batch: it routes its tokens, sends each to the rank holding its expert and
takes the outputs back (two all-to-alls per layer, whose backward is the same exchange reversed).

The expert weights become DTensors sharded on dim 0 over the ``ep`` dim of a 2-D mesh
``(ep_replicate, ep)``; ranks with the same ``ep`` index hold the same experts, and sum their
gradients. The canonical parameters are unchanged (whole ``[E, ...]`` tensors): a rank's experts
are one contiguous range of each, so :class:`geodiloco.site.shards.ShardMap` places them like
FSDP2's dim-0 shards, the ranks of ``ep_replicate`` split them for the outer sync, and the hash
is the same as a DDP site's.

Evaluation needs no peer: switching to eval mode (every rank together, as the site's loop does)
gathers each layer's experts whole, so ranks may score different numbers of batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from geodiloco.config import ConfigError
from geodiloco.workload.moe import GroupedExperts

EXPERT_DIMS = ("ep_replicate", "ep")


class ExpertParallelError(ConfigError):
    """A model that the layout's expert parallelism cannot split (a config error: the site's
    ranks leave with one line naming it)."""


def expert_mesh(ep: int, device_type: str) -> DeviceMesh:
    """The site's ranks as ``(ep_replicate, ep)``: consecutive ranks share out the experts."""
    world = dist.get_world_size()
    if ep < 1 or world % ep:
        raise ValueError(f"layout: ep {ep} must divide the site's {world} ranks")
    return init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=EXPERT_DIMS)


class AllToAll:
    """Sends tokens (sorted by expert) to the ranks of the ``ep`` group holding their experts,
    runs the local experts, and returns the outputs in the tokens' order (differentiably)."""

    def __init__(self, group: ProcessGroup, size: int) -> None:
        self.group = group
        self.size = size
        self.full: tuple[torch.Tensor, torch.Tensor] | None = None  # whole experts, in eval mode

    def __call__(self, experts: GroupedExperts, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.full is not None:  # eval mode: every expert is here
            return experts.compute(tokens, counts, self.full)
        local = counts.numel() // self.size
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)
        # received_counts[s, l]: tokens rank s sends to this rank's expert l
        by_source = received_counts.view(self.size, local)
        send = counts.view(self.size, local).sum(dim=1).tolist()
        receive = by_source.sum(dim=1).tolist()
        received = _exchange(tokens, receive, send, self.group)
        order = _source_to_expert_order(by_source)
        out = experts.compute(received[order], by_source.sum(dim=0))
        return _exchange(out[order.argsort()], send, receive, self.group)

    def set_training(self, experts: GroupedExperts, training: bool) -> None:
        with torch.no_grad():
            self.full = None if training else (_whole(experts.w_in), _whole(experts.w_out))


def _whole(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` whose backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, receive: list[int], send: list[int], group: ProcessGroup
    ) -> torch.Tensor:
        ctx.receive, ctx.send, ctx.group = receive, send, group
        out = x.new_empty((sum(receive), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return back, None, None, None


def _exchange(x: torch.Tensor, receive: list[int], send: list[int], group: ProcessGroup) -> torch.Tensor:
    """Rows of ``x``: ``send[r]`` of them to rank r of ``group``; ``receive[r]`` come from it."""
    out: torch.Tensor = _AllToAll.apply(x, receive, send, group)
    return out


def _source_to_expert_order(by_source: torch.Tensor) -> torch.Tensor:
    """Rows received grouped by (source rank, local expert), reordered by (local expert, source)."""
    sizes = by_source.tolist()  # one copy to the host, then plain integers
    starts, at = [], 0
    for row in sizes:
        starts.append([at + sum(row[:e]) for e in range(len(row))])
        at += sum(row)
    pieces = [
        torch.arange(starts[s][e], starts[s][e] + sizes[s][e])
        for e in range(by_source.shape[1])
        for s in range(by_source.shape[0])
    ]
    return torch.cat(pieces).to(by_source.device)


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, data_parallel: int) -> int:
    """Shard every :class:`GroupedExperts` of ``model`` over ``mesh``'s ``ep`` dim and route its
    tokens with all-to-alls; returns the number of layers split. Call before DDP wraps ``model``:
    the experts are left out of DDP's all-reduce (their gradients are reduced here, averaged over
    the ``data_parallel`` ranks as DDP averages the rest)."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, GroupedExperts)]
    if not layers:
        raise ExpertParallelError("layout: ep > 1 needs a mixture-of-experts model (set model.experts)")
    ep = mesh["ep"]
    size = ep.size()
    replicas = mesh["ep_replicate"].get_group() if mesh["ep_replicate"].size() > 1 else None
    ignored = []
    for name, experts in layers:
        count = experts.w_in.shape[0]
        if count % size:
            raise ExpertParallelError(f"layout: ep {size} must divide the {count} experts of {name}")
        for attr in ("w_in", "w_out"):
            full = getattr(experts, attr)
            # every rank built the same weights from the seed: each keeps its rows, no transfer
            shard = distribute_tensor(full.detach(), mesh, [Replicate(), Shard(0)], src_data_rank=None)
            param = nn.Parameter(shard, requires_grad=full.requires_grad)
            param.register_post_accumulate_grad_hook(_grad_reducer(replicas, data_parallel))
            setattr(experts, attr, param)
            ignored.append(f"{name}.{attr}" if name else attr)
        experts.dispatch = AllToAll(ep.get_group(), size)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    return len(layers)


def _grad_reducer(replicas: ProcessGroup | None, data_parallel: int) -> Callable[[torch.Tensor], None]:
    """After backward: sum an expert's gradient over the ranks holding the same experts, then
    divide by the data-parallel ranks, so it is the mean over all ranks' batches, as DDP's."""

    @torch.no_grad()
    def reduce(p: torch.Tensor) -> None:
        assert p.grad is not None
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        if replicas is not None:
            dist.all_reduce(grad, group=replicas)
        grad.div_(data_parallel)

    return reduce
