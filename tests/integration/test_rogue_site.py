"""A site that pushes a malformed pseudo-gradient is refused; the run goes on without it.

Real processes: a coordinator process, a real site (the site daemon on 2 gloo ranks, pooled
rank processes of the test worker: tests/rank_pool.py), and a rogue client in the test process
speaking raw gRPC.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from geodiloco.app.status import fetch_status, request_shutdown
from geodiloco.compression import encode_chunks, parse_pipeline
from geodiloco.site.edge.client import OuterSyncClient, delta_messages
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.processes import start_coordinator_process
from geodiloco.testing.rank_pool import RankPool, start_sites
from geodiloco.v1 import outer_sync_pb2_grpc

pytestmark = pytest.mark.integration


def test_wrong_shape_push_is_refused_and_the_round_completes_with_the_other_site(
    rank_pool: RankPool, tmp_path
) -> None:
    cfg = tiny_config(sites=["site-a", "rogue"], min_sites=1, rounds=2, round_timeout_s=3.0, lease_s=4.0)
    coordinator, target = start_coordinator_process(cfg, tmp_path)
    try:
        rogue = OuterSyncClient(target, "rogue")
        info = rogue.join()
        start_sites(rank_pool, target, {"site-a": (2, [])}, tmp_path)
        codec = parse_pipeline(cfg.compression.uplink)
        chunks, _ = encode_chunks(codec, torch.randn(info.num_params + 10), 1 << 20, round_=0)
        messages = delta_messages(info.run_id, "rogue", 0, codec.spec, chunks, 1000, info.data)
        with pytest.raises(grpc.RpcError) as err:
            outer_sync_pb2_grpc.OuterSyncStub(rogue.channel).PushDelta(iter(messages), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "outside the model's" in err.value.details()

        rank_pool.wait(240)  # both ranks of site-a left the run
        status = fetch_status(target, None)
        assert status.finished and [list(h.contributors) for h in status.history] == [["site-a"], ["site-a"]]
        assert all(h.hashes_agree and h.hash_reports == 1 for h in status.history)
        by_name = {s.site: s for s in status.sites}
        assert by_name["rogue"].rejected == 1 and by_name["rogue"].accepted == 0
        assert by_name["site-a"].accepted == 2 and by_name["site-a"].rejected == 0
        request_shutdown(target, None)
        assert coordinator.wait(timeout=30) == 0
    finally:
        rank_pool.abandon()
        if coordinator.poll() is None:
            coordinator.kill()
