"""The WAN emulation proxy, with a real coordinator and real gRPC clients behind it."""

from __future__ import annotations

import time

import grpc
import pytest

from geodiloco.site.client import OuterSyncClient
from geodiloco.status import fetch_status
from geodiloco.v1 import outer_sync_pb2
from geodiloco.wan import LinkConfig, ProxyThread
from helpers import CoordinatorThread, tiny_config

pytestmark = pytest.mark.integration


@pytest.fixture
def coordinator():  # type: ignore[no-untyped-def]
    with CoordinatorThread(tiny_config()) as c:
        yield c


def test_latency_is_added_each_way(coordinator: CoordinatorThread) -> None:
    with ProxyThread(coordinator.target, LinkConfig(latency_ms=60)) as proxy:
        fetch_status(proxy.address, None)  # connection set-up
        started = time.monotonic()
        for _ in range(3):
            fetch_status(proxy.address, None)
        per_call = (time.monotonic() - started) / 3
    assert per_call >= 0.12  # a new channel per call: at least one round trip of 2 x 60 ms


def test_bandwidth_is_limited(coordinator: CoordinatorThread) -> None:
    with ProxyThread(coordinator.target, LinkConfig(bandwidth_mbps=1)) as proxy:
        client = OuterSyncClient(proxy.address, "site-a")
        client.join()
        started = time.monotonic()
        state = client.pull_tensor(0, coordinator.controller.num_params, full_state=True)
        elapsed = time.monotonic() - started
    assert state.values.numel() == coordinator.controller.num_params
    assert client.bytes_received > 20_000
    assert elapsed >= client.bytes_received * 8 / 1e6 * 0.9


def test_partition_stalls_calls_and_heal_lets_them_through(coordinator: CoordinatorThread) -> None:
    with ProxyThread(coordinator.target) as proxy:
        client = OuterSyncClient(proxy.address, "site-a")
        client.join()
        proxy.partition()
        request = outer_sync_pb2.HeartbeatRequest(run_id=client.run_id, site="site-a")
        with pytest.raises(grpc.RpcError) as err:
            client.stub.Heartbeat(request, timeout=1.0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        proxy.heal()
        assert client.heartbeat(0).round == 0


def test_reset_drops_connections_and_clients_reconnect(coordinator: CoordinatorThread) -> None:
    with ProxyThread(coordinator.target) as proxy:
        client = OuterSyncClient(proxy.address, "site-a")
        client.join()
        proxy.reset()
        time.sleep(0.2)
        assert client.heartbeat(0).round == 0  # gRPC reconnects through the proxy
    assert coordinator.controller.sites["site-a"].state == "joined"
