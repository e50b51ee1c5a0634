"""Hostile input against a real mTLS coordinator: each attempt gets its own status and message,
the offender's contribution is dropped, the committed state is unchanged and the run goes on."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch

from geodiloco.compression import envelope
from geodiloco.compression.pipeline import parse_pipeline
from geodiloco.security.chunks import seal_delta
from geodiloco.security.secrets import load_secret
from geodiloco.site.edge.client import OuterSyncClient
from geodiloco.testing.servers import CoordinatorThread
from geodiloco.v1 import outer_sync_pb2_grpc

from .conftest import (
    Pki,
    assert_run_continues,
    assert_unchanged,
    delta_messages,
    push_raw,
    refused,
    small_delta,
)

pytestmark = pytest.mark.integration

Attack = Callable[[CoordinatorThread, OuterSyncClient], grpc.RpcError]
Code = grpc.StatusCode


def _flip(data: bytes, index: int) -> bytes:
    out = bytearray(data)
    out[index] ^= 0x01
    return bytes(out)


def malformed_unary(c: CoordinatorThread, a: OuterSyncClient) -> grpc.RpcError:
    join = a.channel.unary_unary("/geodiloco.v1.OuterSync/Heartbeat")
    return refused(lambda: join(b"\x0a\xff\xff\xff\x0f", timeout=5))


def malformed_stream(c: CoordinatorThread, a: OuterSyncClient) -> grpc.RpcError:
    push = a.channel.stream_unary("/geodiloco.v1.OuterSync/PushDelta")
    return refused(lambda: push(iter([b"\x0a\x05\x08"]), timeout=5))


def oversized(c: CoordinatorThread, a: OuterSyncClient) -> grpc.RpcError:
    msgs = delta_messages(a, 0, small_delta(c.controller.num_params))
    msgs[0].payload = b"\0" * 70_000  # the configured limit is 65536 bytes
    return refused(lambda: push_raw(a, msgs))


def stalled(c: CoordinatorThread, a: OuterSyncClient) -> grpc.RpcError:
    msgs = delta_messages(a, 0, small_delta(c.controller.num_params))
    release = threading.Event()

    def never_finishes() -> Iterator[Any]:
        yield msgs[0]
        release.wait(10)  # a stream that stops sending; limits.chunk_timeout_s is 1 s

    stub = outer_sync_pb2_grpc.OuterSyncStub(a.channel)
    try:
        return refused(lambda: stub.PushDelta(never_finishes(), timeout=30))
    finally:
        release.set()


def future_round(c: CoordinatorThread, a: OuterSyncClient) -> grpc.RpcError:
    return refused(lambda: push_raw(a, delta_messages(a, 2, small_delta(c.controller.num_params))))


def wrong_fragment(c: CoordinatorThread, a: OuterSyncClient) -> grpc.RpcError:
    msgs = delta_messages(a, 0, small_delta(c.controller.num_params), seal=False)
    for m in msgs:
        m.header.fragment = 3
    return refused(lambda: push_raw(a, msgs))


def wrong_shape(c: CoordinatorThread, a: OuterSyncClient) -> grpc.RpcError:
    return refused(lambda: push_raw(a, delta_messages(a, 0, small_delta(c.controller.num_params - 7))))


def wrong_dtype(c: CoordinatorThread, a: OuterSyncClient) -> grpc.RpcError:
    n = c.controller.num_params
    msgs = delta_messages(a, 0, small_delta(n), seal=False)
    tag = parse_pipeline(msgs[0].header.codec).tag
    for m in msgs:  # half-precision bytes in a well-formed frame labelled as the run's fp32 codec
        body = torch.zeros(m.header.numel, dtype=torch.float16).numpy().tobytes()
        m.payload = envelope.seal(tag, m.header.numel, body)
    for m in msgs:
        assert a.keys is not None
        seal_delta(a.keys.up, m)
    return refused(lambda: push_raw(a, msgs))


def wrong_codec(c: CoordinatorThread, a: OuterSyncClient) -> grpc.RpcError:
    n = c.controller.num_params
    return refused(lambda: push_raw(a, delta_messages(a, 0, small_delta(n), codec="q8|zstd:3")))


def non_finite(c: CoordinatorThread, a: OuterSyncClient) -> grpc.RpcError:
    msgs = delta_messages(a, 0, small_delta(c.controller.num_params), seal=False)
    values = torch.zeros(msgs[0].header.numel)
    values[5], values[9] = float("nan"), float("inf")
    # a well-formed fp32 frame around non-finite values: the site's encoder would refuse them
    msgs[0].payload = envelope.seal(
        parse_pipeline(msgs[0].header.codec).tag, values.numel(), values.numpy().tobytes()
    )
    for m in msgs:
        assert a.keys is not None
        seal_delta(a.keys.up, m)
    return refused(lambda: push_raw(a, msgs))


def absurd_norm(c: CoordinatorThread, a: OuterSyncClient) -> grpc.RpcError:
    delta = torch.full((c.controller.num_params,), 50.0)  # far larger than the whole model
    return refused(lambda: push_raw(a, delta_messages(a, 0, delta)))


def flipped_payload_byte(c: CoordinatorThread, a: OuterSyncClient) -> grpc.RpcError:
    msgs = delta_messages(a, 0, small_delta(c.controller.num_params))
    msgs[-1].payload = _flip(msgs[-1].payload, len(msgs[-1].payload) // 2)
    return refused(lambda: push_raw(a, msgs))


def altered_tokens(c: CoordinatorThread, a: OuterSyncClient) -> grpc.RpcError:
    msgs = delta_messages(a, 0, small_delta(c.controller.num_params))
    for m in msgs:  # a proxy inflating this site's weight in the average
        m.tokens *= 1000
    return refused(lambda: push_raw(a, msgs))


def unsealed(c: CoordinatorThread, a: OuterSyncClient) -> grpc.RpcError:
    return refused(
        lambda: push_raw(a, delta_messages(a, 0, small_delta(c.controller.num_params), seal=False))
    )


def other_key(c: CoordinatorThread, a: OuterSyncClient) -> grpc.RpcError:
    msgs = delta_messages(a, 0, small_delta(c.controller.num_params))
    for m in msgs:
        m.header.key_id ^= 0x5A5A
    return refused(lambda: push_raw(a, msgs))


def not_joined(c: CoordinatorThread, a: OuterSyncClient) -> grpc.RpcError:
    a.leave("testing")
    err = refused(lambda: push_raw(a, delta_messages(a, 0, small_delta(c.controller.num_params))))
    a.join()
    return err


def join_flood(c: CoordinatorThread, a: OuterSyncClient) -> grpc.RpcError:
    for _ in range(4):  # limits.joins_per_minute is 5, one used by the fixture
        a.join()
    return refused(a.join)


ATTACKS: dict[str, tuple[Attack, Code, str]] = {
    "malformed unary request": (malformed_unary, Code.INVALID_ARGUMENT, "malformed HeartbeatRequest"),
    "malformed stream message": (malformed_stream, Code.INVALID_ARGUMENT, "malformed DeltaChunk"),
    "message over the size limit": (oversized, Code.RESOURCE_EXHAUSTED, "larger than max"),
    "stream that never finishes": (stalled, Code.DEADLINE_EXCEEDED, "chunk_timeout_s"),
    "not joined": (not_joined, Code.FAILED_PRECONDITION, "has not joined"),
    "future round": (future_round, Code.FAILED_PRECONDITION, "not open yet"),
    "wrong fragment": (wrong_fragment, Code.INVALID_ARGUMENT, "fragment 3 does not exist"),
    "wrong shape": (wrong_shape, Code.INVALID_ARGUMENT, "elements"),
    "wrong dtype": (wrong_dtype, Code.INVALID_ARGUMENT, "bytes"),
    "wrong codec": (wrong_codec, Code.INVALID_ARGUMENT, "uplink codec"),
    "NaN and Inf": (non_finite, Code.INVALID_ARGUMENT, "NaN or Inf"),
    "absurd norm": (absurd_norm, Code.INVALID_ARGUMENT, "max_delta_norm_ratio"),
    "one flipped payload byte": (flipped_payload_byte, Code.INVALID_ARGUMENT, "authentication tag"),
    "altered header field": (altered_tokens, Code.INVALID_ARGUMENT, "authentication tag"),
    "unsealed chunk": (unsealed, Code.FAILED_PRECONDITION, "not sealed"),
    "chunk under another key": (other_key, Code.FAILED_PRECONDITION, "key id"),
    "flood of joins": (join_flood, Code.RESOURCE_EXHAUSTED, "joins_per_minute"),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_hostile_input_is_refused_and_the_run_goes_on(
    name: str, coordinator: CoordinatorThread, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    attack, code, message = ATTACKS[name]
    a, b = pki.client(coordinator.target, "site-a"), pki.client(coordinator.target, "site-b")
    a.join(), b.join()
    with caplog.at_level(logging.WARNING, logger="geodiloco"):
        err = attack(coordinator, a)
    assert err.code() == code, err.details()
    assert message in err.details()
    if code != Code.RESOURCE_EXHAUSTED or "joins" in message:  # gRPC refuses oversize before us
        assert any(r.levelno >= logging.WARNING and "refused" in r.getMessage() for r in caplog.records)
    assert_unchanged(coordinator)
    assert_run_continues(coordinator, [a, b])


def test_a_valid_chunk_replayed_into_the_next_round_is_rejected(
    coordinator: CoordinatorThread, pki: Pki
) -> None:
    a, b = pki.client(coordinator.target, "site-a"), pki.client(coordinator.target, "site-b")
    a.join(), b.join()
    n = coordinator.controller.num_params
    captured = delta_messages(a, 0, small_delta(n, seed=7))
    assert not push_raw(a, captured).duplicate
    assert push_raw(a, captured).duplicate  # the same push again is an idempotent no-op
    assert not push_raw(b, delta_messages(b, 0, small_delta(n, seed=8))).duplicate
    assert a.pull(0, n).next_round == b.pull(0, n).next_round == 1  # (and learn round 1's data)
    for m in captured:
        m.header.round = 1
    err = refused(lambda: push_raw(a, captured))
    assert err.code() == Code.INVALID_ARGUMENT and "authentication tag" in err.details()
    assert coordinator.controller.sites["site-a"].rejected == 1
    assert_unchanged(coordinator, round_=1)
    assert_run_continues(coordinator, [a, b], round_=1)


def test_secrets_never_reach_logs_or_error_messages(
    coordinator: CoordinatorThread, pki: Pki, other_pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    secrets = [load_secret(pki.dir.run_secret), *(load_secret(s) for _, s in pki.sites.values())]
    a = pki.client(coordinator.target, "site-a")
    details = []
    with caplog.at_level(logging.DEBUG):
        a.join()
        for attack in (flipped_payload_byte, other_key, unsealed, altered_tokens):
            details.append(attack(coordinator, a).details())
        details.append(repr(coordinator.security.keyring) + repr(a.keys))
    text = caplog.text + "\n".join(details)
    assert "authentication tag" in text
    for secret in secrets:
        for form in (secret.hex(), secret.hex().upper(), repr(secret), secret.decode("latin-1")):
            assert form not in text
    assert_unchanged(coordinator)
