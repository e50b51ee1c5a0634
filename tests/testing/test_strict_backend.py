"""The NCCL stand-in refuses what NCCL would, and geodiloco's control collectives avoid it.

Two real rank processes start ``strictnccl`` as their default group (a stand-in for NCCL:
gloo underneath, no GPU here): a CPU tensor from this file's code is refused, DDP's own
collectives pass, and the site's control group is a gloo group of its own that takes geodiloco's
agreement, object and chunk collectives. Over a plain gloo default group the control group is
the default group itself."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from geodiloco.compression import EncodedChunk
from geodiloco.distributed import control_group, takes_cpu_tensors
from geodiloco.site.group import SiteGroup
from geodiloco.site.outer_sync import Outcome
from geodiloco.testing import strict_backend
from geodiloco.testing.rank_pool import RankPool
from geodiloco.testing.servers import free_port

pytestmark = pytest.mark.integration


def _refusal(fn: Any) -> str:
    try:
        fn()
    except strict_backend.CpuTensorRefused as exc:
        return str(exc)
    return ""


def _strict_rank(rank: int, port: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    strict_backend.init_default_group()
    try:
        result: dict[str, Any] = {"rank": rank, "takes_cpu": takes_cpu_tensors()}
        flag = torch.tensor([rank], dtype=torch.int64)
        result["refused"] = _refusal(lambda: dist.all_reduce(flag))
        result["refused_object"] = _refusal(lambda: dist.broadcast_object_list([rank], src=0))
        result["refused_site_group"] = ""
        try:
            SiteGroup(dist.group.WORLD)
        except ValueError as exc:
            result["refused_site_group"] = str(exc)

        model = torch.nn.Linear(3, 1, bias=False)
        ddp = DistributedDataParallel(model)  # its broadcasts and all-reduces are torch's own
        ddp(torch.full((1, 3), float(rank + 1))).sum().backward()
        assert model.weight.grad is not None
        result["grad"] = model.weight.grad.tolist()

        group = SiteGroup()
        result["own_group"] = group.group is not None and group.group is control_group()
        result["same_group_again"] = SiteGroup().group is group.group
        result["agree"] = group.agree(Outcome.RESYNC if rank == 1 else Outcome.OK)
        result["joined"] = group.broadcast({"round": 3} if rank == 0 else None)
        result["gathered"] = group.gather(rank * 10)
        result["sum"] = group.sum(rank + 1)
        result["floats"] = group.sum_floats([0.5, float(rank)])
        chunk = group.share_chunk(EncodedChunk(4, 2, b"\x01\x02") if rank == 1 else None, src=1)
        result["chunk"] = (chunk.start, chunk.numel, chunk.payload)
        del ddp
        out.put(result)
    finally:
        dist.destroy_process_group()


def test_the_standin_refuses_cpu_tensors_and_the_control_path_uses_its_own_gloo_group(
    rank_pool: RankPool,
) -> None:
    port = free_port()
    results = sorted(
        rank_pool.run(_strict_rank, [(r, port) for r in range(2)], timeout=120), key=lambda r: r["rank"]
    )
    for r in results:
        assert r["takes_cpu"] is False
        assert "stand-in for NCCL" in r["refused"] and "allreduce" in r["refused"]
        assert "test_strict_backend.py" in r["refused"]  # names the code that passed the tensor
        assert "stand-in for NCCL" in r["refused_object"]
        assert "group: its backend 'strictnccl' cannot take the CPU tensors" in r["refused_site_group"]
        assert r["grad"] == [[1.5, 1.5, 1.5]]  # DDP averaged the ranks' gradients (1 and 2)
        assert r["own_group"] and r["same_group_again"]
        assert r["agree"] is Outcome.RESYNC
        assert r["joined"] == {"round": 3}
        assert r["gathered"] == [0, 10] and r["sum"] == 3 and r["floats"] == [1.0, 1.0]
        assert r["chunk"] == (4, 2, b"\x01\x02")


def test_over_a_gloo_default_group_the_control_group_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)  # in this process, for a moment
    try:
        assert takes_cpu_tensors() and control_group() is None and SiteGroup().group is None
    finally:
        dist.destroy_process_group()
