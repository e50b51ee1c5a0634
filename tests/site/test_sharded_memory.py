"""An FSDP2 site's outer sync never allocates a model-sized tensor on any rank.

Two real gloo ranks shard the reference model with FSDP2 and sync with a real coordinator over
loopback; a dispatch mode records every tensor storage the outer sync creates, and when each is
freed, so the test sees the largest single allocation and the peak of live bytes.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from geodiloco.params import HASH_BLOCK
from geodiloco.site import connect
from geodiloco.site.parallel.layout import ParallelConfig, build_mesh, parallelize
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.rank_pool import RankPool
from geodiloco.testing.servers import CoordinatorThread, free_port
from geodiloco.workload import build_model

pytestmark = pytest.mark.integration

CHUNK = 512


class StorageTracker(TorchDispatchMode):
    """Live bytes of the storages created while active (peak and largest single one)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.largest = 0
        self.seen: set[int] = set()

    def _freed(self, key: int, size: int) -> None:
        self.live -= size
        self.seen.discard(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in self.seen:
                continue
            self.seen.add(key)
            self.live += size
            self.peak, self.largest = max(self.peak, self.live), max(self.largest, size)
            weakref.finalize(storage, self._freed, key, size)
        return out


def _rank_main(rank: int, target: str, port: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        sync = connect(target, "site-a")
        cfg = sync.config
        model = build_model(cfg.model, cfg.seed)
        layout = ParallelConfig.parse("fsdp", 2)
        parallelize(model, layout, build_mesh(layout))
        sync.attach(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, 256, (2, cfg.model.seq_len), generator=torch.Generator().manual_seed(rank))
        for _ in range(cfg.inner.steps_per_round - 1):
            model(x, x).backward()
            optimizer.step()
            optimizer.zero_grad()
            sync.step(tokens=x.numel())
        model(x, x).backward()
        optimizer.step()
        with StorageTracker() as tracker:
            synced = sync.step(tokens=x.numel())
        assert sync.shards is not None
        out.put(
            {
                "rank": rank,
                "synced": synced,
                "peak": tracker.peak,
                "largest": tracker.largest,
                "local_bytes": sync.shards.local_numel * 4,
                "model_bytes": sync.shards.num_params * 4,
                "hash": sync.last_result.state_hash if sync.last_result else "",
            }
        )
        sync.close()
    finally:
        dist.destroy_process_group()


def test_fsdp_outer_sync_stays_within_the_shard(rank_pool: RankPool) -> None:
    cfg = tiny_config(rounds=1, sites=["site-a"], model__d_model=32, compression__chunk_elements=CHUNK)
    with CoordinatorThread(cfg) as coordinator:
        port = free_port()
        results = rank_pool.run(_rank_main, [(r, coordinator.target, port) for r in range(2)], timeout=300)
        expected = coordinator.controller.hashes[1]
    for r in results:
        print(r)
        assert r["synced"] and r["hash"] == expected
        assert r["local_bytes"] < r["model_bytes"]
        # no tensor as large as the model, nor even as a rank's shard, is ever created
        assert r["largest"] <= r["local_bytes"] < r["model_bytes"]
        # Δ, its compensated copy and its decoded copy, the hash's scratch, a few chunks in flight
        assert r["peak"] <= 3 * r["local_bytes"] + 24 * HASH_BLOCK + 4 * CHUNK * 4
