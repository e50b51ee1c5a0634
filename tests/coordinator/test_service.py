"""The coordinator's gRPC service, against a real server on loopback with raw clients."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from geodiloco.compression import EncodedChunk, encode_chunks, parse_pipeline
from geodiloco.exchange import StreamFacts
from geodiloco.params import state_hash
from geodiloco.site.edge.client import OuterSyncClient, delta_messages
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.servers import CoordinatorThread
from geodiloco.v1 import outer_sync_pb2_grpc

pytestmark = pytest.mark.integration


def push_messages(
    client: OuterSyncClient,
    round_: int,
    delta: torch.Tensor,
    tokens: int = 100,
    codec: str = "q8|zstd:3",
    chunk_elements: int = 1 << 20,
) -> list[Any]:
    chunks, _ = encode_chunks(parse_pipeline(codec), delta, chunk_elements, round_=round_)
    return delta_messages(client.run_id, client.site, round_, codec, chunks, tokens, client.assigned)


@pytest.fixture
def coordinator() -> Any:
    cfg = tiny_config(min_sites=1, round_timeout_s=2.0, rounds=2)
    with CoordinatorThread(cfg) as c:
        yield c


def test_wrong_shape_is_invalid_argument_and_round_completes_with_the_other_site(
    coordinator: CoordinatorThread,
) -> None:
    n = coordinator.controller.num_params
    good, bad = OuterSyncClient(coordinator.target, "site-a"), OuterSyncClient(coordinator.target, "site-b")
    good.join(), bad.join()
    stub = outer_sync_pb2_grpc.OuterSyncStub(bad.channel)
    with pytest.raises(grpc.RpcError) as err:
        stub.PushDelta(iter(push_messages(bad, 0, torch.randn(n + 5))), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the model" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.PushDelta(iter(push_messages(bad, 0, torch.randn(n - 5))), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert coordinator.controller.round == 0
    assert coordinator.controller.sites["site-b"].rejected == 2

    delta = torch.randn(n) * 1e-2
    good.push(
        0, "q8|zstd:3", encode_chunks(parse_pipeline("q8|zstd:3"), delta, 1 << 20, round_=0)[0], tokens=64
    )
    pulled = good.pull_tensor(0, n)  # the round closes at its deadline with site-a alone
    assert pulled.next_round == 1 and not pulled.is_full_state
    record = coordinator.controller.history[0]
    assert record.contributors == ["site-a"]
    assert pulled.state_hash == coordinator.controller.hashes[1]


def test_push_is_idempotent(coordinator: CoordinatorThread) -> None:
    n = coordinator.controller.num_params
    a = OuterSyncClient(coordinator.target, "site-a")
    a.join()
    msgs = push_messages(a, 0, torch.randn(n) * 1e-2, chunk_elements=1000)
    assert len(msgs) > 1
    stub = outer_sync_pb2_grpc.OuterSyncStub(a.channel)
    first = stub.PushDelta(iter(msgs), timeout=10)
    again = stub.PushDelta(iter(msgs), timeout=10)
    assert not first.duplicate and again.duplicate
    assert coordinator.controller.sites["site-a"].accepted == 1


def test_unknown_site_and_wrong_run_are_refused(coordinator: CoordinatorThread) -> None:
    with pytest.raises(grpc.RpcError) as err:
        OuterSyncClient(coordinator.target, "intruder").join()
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as err:
        OuterSyncClient(coordinator.target, "site-a").join(run_id="other-run")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_bad_pushes_get_specific_statuses(coordinator: CoordinatorThread) -> None:
    n = coordinator.controller.num_params
    a = OuterSyncClient(coordinator.target, "site-a")
    stub = outer_sync_pb2_grpc.OuterSyncStub(a.channel)
    with pytest.raises(grpc.RpcError) as err:  # not joined yet
        stub.PushDelta(iter(push_messages(a, 0, torch.zeros(n))), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    a.join()
    cases = {
        "future round": (push_messages(a, 5, torch.zeros(n)), grpc.StatusCode.FAILED_PRECONDITION),
        "codec": (push_messages(a, 0, torch.zeros(n), codec="fp32"), grpc.StatusCode.INVALID_ARGUMENT),
        "tokens": (push_messages(a, 0, torch.zeros(n), tokens=0), grpc.StatusCode.INVALID_ARGUMENT),
    }
    corrupt = push_messages(a, 0, torch.randn(n))
    corrupt[0].payload = corrupt[0].payload[:-7]
    cases["truncated"] = (corrupt, grpc.StatusCode.INVALID_ARGUMENT)
    for name, (msgs, code) in cases.items():
        with pytest.raises(grpc.RpcError) as err:
            stub.PushDelta(iter(msgs), timeout=10)
        assert err.value.code() == code, name
        assert err.value.details(), name
    assert coordinator.controller.round == 0 and not coordinator.controller.mean.contributors
    assert state_hash(coordinator.controller.theta) == coordinator.controller.hashes[0]


def test_pull_waits_for_commit_and_all_clients_get_identical_bytes(coordinator: CoordinatorThread) -> None:
    n = coordinator.controller.num_params
    a, b = OuterSyncClient(coordinator.target, "site-a"), OuterSyncClient(coordinator.target, "site-b")
    a.join(), b.join()
    codec = parse_pipeline("q8|zstd:3")
    with pytest.raises(grpc.RpcError) as err:  # waiting without a contribution could never end
        b.pull_tensor(0, n)
    assert err.value.code() == grpc.StatusCode.ABORTED
    b.push(0, codec.spec, encode_chunks(codec, torch.randn(n) * 1e-2, 1 << 20, round_=0)[0], tokens=10)
    results: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: results.setdefault("b", b.pull_tensor(0, n)))
    waiter.start()
    time.sleep(0.5)
    assert not results  # still waiting for site-a
    a.push(0, codec.spec, encode_chunks(codec, torch.randn(n) * 1e-2, 1 << 20, round_=0)[0], tokens=10)
    waiter.join(10)
    pulled_a = a.pull_tensor(0, n)
    assert torch.equal(pulled_a.values, results["b"].values)
    full = a.pull_tensor(0, n, full_state=True)
    assert full.is_full_state and full.next_round == 1
    assert state_hash(full.values) == pulled_a.state_hash == coordinator.controller.hashes[1]
    # the coordinator counts what crossed the wire (pulls are encoded with their payload appended,
    # pushes measured as they arrived) exactly as the client counts the messages it parsed
    record = coordinator.controller.sites["site-a"]
    assert (record.bytes_in, record.bytes_out) == (a.bytes_sent, a.bytes_received)


def test_health_and_reflection_are_served(coordinator: CoordinatorThread) -> None:
    with grpc.insecure_channel(coordinator.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "geodiloco.v1.OuterSync", "geodiloco.v1.Admin"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        reply = next(
            stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
        )
        names = {s.name for s in reply.list_services_response.service}
        assert {"geodiloco.v1.OuterSync", "geodiloco.v1.Admin", "grpc.health.v1.Health"} <= names


def test_push_stream_broken_midway_leaves_no_trace(coordinator: CoordinatorThread) -> None:
    n = coordinator.controller.num_params
    a = OuterSyncClient(coordinator.target, "site-a")
    a.join()
    msgs = push_messages(a, 0, torch.randn(n) * 1e-2, chunk_elements=1000)

    def dies_after_two_chunks() -> Any:
        yield from msgs[:2]
        raise ConnectionError("site crashed mid-push")

    with pytest.raises(grpc.RpcError) as err:
        outer_sync_pb2_grpc.OuterSyncStub(a.channel).PushDelta(dies_after_two_chunks(), timeout=10)
    assert err.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
    time.sleep(0.2)
    assert not coordinator.controller.mean.contributors and coordinator.controller.round == 0
    ack = outer_sync_pb2_grpc.OuterSyncStub(a.channel).PushDelta(iter(msgs), timeout=10)
    assert not ack.duplicate  # the whole push, resent, is accepted once


@pytest.mark.parametrize(
    ("nonce", "key_id"),
    [(b"\x01" * 12, 0x1234), (b"\x01" * 12, 0), (b"", 7)],
    ids=["sealed", "nonce", "key-id"],
)
def test_sealed_chunk_to_an_insecure_run_is_named(
    coordinator: CoordinatorThread, nonce: bytes, key_id: int
) -> None:
    n = coordinator.controller.num_params
    a = OuterSyncClient(coordinator.target, "site-a")
    a.join()
    msgs = push_messages(a, 0, torch.randn(n) * 1e-2, chunk_elements=1000)
    last = msgs[-1].header  # a later chunk: each one is checked, not only the first
    last.nonce, last.key_id = nonce, key_id
    stub = outer_sync_pb2_grpc.OuterSyncStub(a.channel)
    with pytest.raises(grpc.RpcError) as err:
        stub.PushDelta(iter(msgs), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "this run does not seal payloads (the coordinator runs --insecure)" in err.value.details()
    assert "key_id 0 and no nonce" in err.value.details()
    assert coordinator.controller.sites["site-a"].accepted == 0
    msgs[0].header.nonce = b"\x02" * 12  # and on the first chunk, before anything is staged
    last.nonce, last.key_id = b"", 0
    with pytest.raises(grpc.RpcError) as err:
        stub.PushDelta(iter(msgs), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    msgs[0].header.nonce = b""
    assert not stub.PushDelta(iter(msgs), timeout=10).duplicate  # the clean push still goes in


@contextlib.contextmanager
def one_committed_round() -> Iterator[tuple[OuterSyncClient, int]]:
    """A one-site run whose round 0 committed (chunks of 1000 elements), its site's client and
    the model's size."""
    cfg = tiny_config(min_sites=1, round_timeout_s=2.0, rounds=2, compression__chunk_elements=1000)
    with CoordinatorThread(cfg) as c:
        n = c.controller.num_params
        client = OuterSyncClient(c.target, "site-a")
        client.join()
        chunks, _ = encode_chunks(parse_pipeline("q8|zstd:3"), torch.randn(n) * 1e-2, 1000, round_=0)
        client.push(0, "q8|zstd:3", chunks, tokens=64)
        yield client, n


def test_a_pull_hands_each_chunk_over_as_it_arrives() -> None:
    """``on_chunk`` sees every chunk of the stream, in order, before the pull returns."""
    with one_committed_round() as (client, n):
        seen: list[tuple[int, int, bytes]] = []
        facts: set[StreamFacts] = set()

        def take(seq: int, chunk: EncodedChunk, stream: StreamFacts) -> None:
            seen.append((seq, chunk.start, chunk.payload))
            facts.add(stream)

        pulled = client.pull(0, on_chunk=take)
        assert pulled.total_chunks == -(-n // 1000) > 1
        assert facts == {pulled.stream} and not pulled.is_full_state
        assert [s for s, _, _ in seen] == list(range(pulled.total_chunks))
        assert all(pulled.chunks[s].start == a and pulled.chunks[s].payload == p for s, a, p in seen)


def test_a_pull_whose_sink_takes_the_payloads_keeps_only_their_places() -> None:
    """``keep_payloads=False``: the sink gets every payload, the returned share none, and the
    share's chunks still say which elements came (what a one-rank site checks coverage by)."""
    with one_committed_round() as (client, _):
        kept = client.pull(0)
        taken: dict[int, bytes] = {}
        pulled = client.pull(
            0, on_chunk=lambda s, ch, _: taken.setdefault(s, ch.payload), keep_payloads=False
        )
        assert pulled.total_chunks == len(kept.chunks) > 1
        assert taken == {s: ch.payload for s, ch in kept.chunks.items()}
        assert all(len(ch.payload) > 0 for ch in kept.chunks.values())
        assert {s: (ch.start, ch.numel) for s, ch in pulled.chunks.items()} == {
            s: (ch.start, ch.numel) for s, ch in kept.chunks.items()
        }
        assert all(ch.payload == b"" for ch in pulled.chunks.values())
        with pytest.raises(ValueError, match="needs an on_chunk sink"):
            client.pull(0, keep_payloads=False)
