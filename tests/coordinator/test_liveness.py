"""A long transfer is a heartbeat (issue 16 item 4): a site whose pull outlasts its lease (a slow
link, with its heartbeats queued behind the bulk stream) is not expired while the stream flows."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from geodiloco.site.edge.client import OuterSyncClient
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.servers import CoordinatorThread
from geodiloco.v1 import outer_sync_pb2, outer_sync_pb2_grpc
from geodiloco.wire import PUSHER_KEY

pytestmark = pytest.mark.integration

LEASE_S = 1.5
N = 4_000_000  # 16 MB of full state: far more than the connection's flow-control window


def test_a_pull_that_outlasts_the_lease_keeps_the_site_alive() -> None:
    cfg = tiny_config(lease_s=LEASE_S, heartbeat_interval_s=0.5, compression__chunk_elements=1 << 16)
    with CoordinatorThread(cfg, initial=torch.randn(N, generator=torch.Generator().manual_seed(0))) as c:
        site = OuterSyncClient(c.target, "site-a")
        site.join()
        request = outer_sync_pb2.PullRequest(
            run_id=site.run_id, site="site-a", kind=outer_sync_pb2.PullRequest.FULL_STATE
        )
        # a window that never grows (no BDP probing): the server sends only as fast as this reads
        with grpc.insecure_channel(c.target, options=[("grpc.http2.bdp_probe", 0)]) as slow:
            stub = outer_sync_pb2_grpc.OuterSyncStub(slow)
            chunks = list(stub.PullUpdate(request, timeout=60))  # encoded once, then cached
            site.heartbeat(0)
            started, states = time.monotonic(), set()
            for i, _ in enumerate(stub.PullUpdate(request, timeout=60)):
                time.sleep(0.1)  # a slow reader: 6 s for the state, four leases
                if i % 8 == 0:
                    states.add(c.controller.sites["site-a"].state)
            took = time.monotonic() - started
        assert took > 3 * LEASE_S and len(chunks) > 40
        assert states == {"joined"}, states
        assert c.controller.sites["site-a"].state == "joined"
        time.sleep(LEASE_S + 1.0)  # once the stream has ended, the lease runs out as before
        assert c.controller.sites["site-a"].state == "lost"


def test_a_site_whose_stream_broke_is_not_waited_for_a_whole_lease() -> None:
    """A killed site's connection closes mid-stream: unless it heartbeats again within a few
    intervals it is expired then, not a whole lease later; one that heartbeats stays."""
    cfg = tiny_config(lease_s=30.0, heartbeat_interval_s=0.2, compression__chunk_elements=1 << 16)
    with CoordinatorThread(cfg, initial=torch.randn(N, generator=torch.Generator().manual_seed(0))) as c:
        assert c.controller.suspect_s == pytest.approx(0.6)
        quiet, beating = OuterSyncClient(c.target, "site-a"), OuterSyncClient(c.target, "site-b")
        for client in (quiet, beating):
            client.join()
            request = outer_sync_pb2.PullRequest(
                run_id=client.run_id, site=client.site, kind=outer_sync_pb2.PullRequest.FULL_STATE
            )
            with grpc.insecure_channel(c.target, options=[("grpc.http2.bdp_probe", 0)]) as channel:
                call = outer_sync_pb2_grpc.OuterSyncStub(channel).PullUpdate(request, timeout=60)
                next(call)  # the stream flows (16 MB: far more than the window) ...
                call.cancel()  # ... and breaks, as a killed process's connection does
        broke = time.monotonic()
        while c.controller.sites["site-a"].state == "joined":
            assert time.monotonic() - broke < 10, "the quiet site was waited for too long"
            beating.heartbeat(0)
            time.sleep(0.1)
        assert c.controller.sites["site-a"].state == "lost"
        assert time.monotonic() - broke < cfg.lease_s / 3
        assert c.controller.sites["site-b"].state == "joined"


@pytest.mark.parametrize("named", [True, False])
def test_a_push_whose_first_chunk_outlasts_the_lease_keeps_the_site_alive(named: bool) -> None:
    """One chunk can take longer than a lease to cross a slow link (a model under
    ``compression.chunk_elements`` pushes a single chunk): the stream's opener is named in its
    metadata, so its lease is held from the first byte. Unnamed, the site expires as it waits."""
    cfg = tiny_config(lease_s=LEASE_S, heartbeat_interval_s=0.5)
    with CoordinatorThread(cfg, initial=torch.zeros(1000)) as c:
        site = OuterSyncClient(c.target, "site-a")
        site.join()

        def first_chunk_never_arrives():  # type: ignore[no-untyped-def]
            time.sleep(3 * LEASE_S)
            return
            yield

        metadata = ((PUSHER_KEY, "site-a"),) if named else ()
        with grpc.insecure_channel(c.target) as channel:
            stub = outer_sync_pb2_grpc.OuterSyncStub(channel)
            call = stub.PushDelta.future(first_chunk_never_arrives(), timeout=60, metadata=metadata)
            states = set()
            while not call.done():
                states.add(c.controller.sites["site-a"].state)
                time.sleep(0.1)
            assert call.exception() is not None and call.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert states == ({"joined"} if named else {"joined", "lost"}), states


def test_a_push_opened_as_one_site_cannot_carry_another_sites_chunks() -> None:
    cfg = tiny_config(lease_s=30.0)
    with CoordinatorThread(cfg, initial=torch.zeros(1000)) as c:
        for name in ("site-a", "site-b"):
            OuterSyncClient(c.target, name).join()
        header = outer_sync_pb2.ChunkHeader(
            run_id=cfg.run_id, round=0, site="site-b", codec="fp32", numel=1000
        )
        chunk = outer_sync_pb2.DeltaChunk(header=header, payload=bytes(4000))
        with grpc.insecure_channel(c.target) as channel:
            stub = outer_sync_pb2_grpc.OuterSyncStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.PushDelta(iter([chunk]), timeout=30, metadata=((PUSHER_KEY, "site-a"),))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "opened as site 'site-a'" in (refused.value.details() or "")
