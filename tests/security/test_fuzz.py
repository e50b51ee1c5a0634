"""Bounded fuzzing (hypothesis) of every entry point that hostile bytes reach: request decoding,
chunk opening, push validation, codec decoding, and a live mTLS coordinator. Zero crashes means
only the refusals each entry point documents, never another exception or an UNKNOWN status."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geodiloco.compression import CodecError, parse_pipeline
from geodiloco.coordinator.edge.server import data_shard_sizes, initial_parameters
from geodiloco.coordinator.edge.service import OuterSyncServicer
from geodiloco.coordinator.refusals import CoordinatorError
from geodiloco.coordinator.rounds import RoundController
from geodiloco.params import state_hash
from geodiloco.security.chunks import open_delta, open_update
from geodiloco.security.raw_requests import MalformedRequest, decode
from geodiloco.security.sealing import Keyring, SealError
from geodiloco.testing.servers import PLAINTEXT
from geodiloco.v1 import admin_pb2, outer_sync_pb2

from .conftest import Pki, hostile_config, secure_coordinator

FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
REQUESTS = [
    outer_sync_pb2.JoinRequest,
    outer_sync_pb2.HeartbeatRequest,
    outer_sync_pb2.DeltaChunk,
    outer_sync_pb2.PullRequest,
    outer_sync_pb2.ReportRequest,
    outer_sync_pb2.LeaveRequest,
    admin_pb2.ShutdownRequest,
]
u32, u64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
small = st.integers(0, 20_000)
text = st.sampled_from(["", "test-run", "site-a", "site-b", "fp32", "q8|zstd:3", "é\0x"])
headers = st.builds(
    outer_sync_pb2.ChunkHeader,
    run_id=text,
    round=st.one_of(small, u64),
    fragment=st.one_of(st.just(0), u32),
    site=text,
    codec=text,
    seq=st.one_of(st.integers(0, 4), u32),
    start=st.one_of(small, u64),
    numel=st.one_of(small, u64),
    nonce=st.binary(max_size=16),
    key_id=u32,
)
deltas = st.builds(
    outer_sync_pb2.DeltaChunk,
    header=headers,
    payload=st.binary(max_size=256),
    tokens=st.one_of(small, u64),
    total_chunks=st.one_of(st.integers(0, 4), u32),
)


@FUZZ
@given(cls=st.sampled_from(REQUESTS), data=st.binary(max_size=512))
def test_request_decoding_refuses_or_parses(cls: Any, data: bytes) -> None:
    try:
        assert isinstance(decode(cls, data), cls)
    except MalformedRequest as exc:
        assert cls.DESCRIPTOR.name in str(exc)


@FUZZ
@given(msg=deltas, as_update=st.booleans())
def test_opening_arbitrary_chunks_only_ever_refuses(msg: Any, as_update: bool) -> None:
    keys = Keyring(bytes(32), "test-run").site("site-a")
    with pytest.raises(SealError):
        if as_update:
            update = outer_sync_pb2.UpdateChunk(header=msg.header, payload=msg.payload, kind=msg.tokens % 4)
            open_update(keys.down, update)
        else:
            open_delta(keys.up, msg)


@FUZZ
@given(spec=st.sampled_from(["fp32", "q8", "q8:64|zstd:3", "fp32|zstd:1"]), data=st.binary(max_size=2048))
def test_codec_decoding_only_ever_refuses(spec: str, data: bytes) -> None:
    numel = max(1, len(data) // 4)
    try:
        out = parse_pipeline(spec).decode(data, numel)
    except CodecError:
        return
    assert out.numel() == numel


@pytest.fixture(scope="module")
def servicer() -> OuterSyncServicer:
    cfg = hostile_config()
    controller = RoundController(cfg, initial_parameters(cfg), data_shard_sizes(cfg))
    for record in controller.sites.values():
        record.state = "joined"
    return OuterSyncServicer(controller, PLAINTEXT)


@FUZZ
@given(first=deltas, chunks=st.lists(deltas, max_size=3))
def test_push_validation_only_ever_refuses(
    servicer: OuterSyncServicer, first: Any, chunks: list[Any]
) -> None:
    try:
        fragment = servicer.run.fragment(first.header.fragment)
        asyncio.run(servicer.pushes._begin(fragment, first))
        for index, chunk in enumerate([first, *chunks]):
            servicer.pushes.intakes[-1].check_chunk(first, chunk, index)
    except CoordinatorError as exc:
        assert str(exc)
    assert servicer.c.round == 0 and not servicer.c.mean.contributors


ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


@pytest.mark.integration
def test_live_coordinator_survives_arbitrary_push_streams(pki: Pki) -> None:
    with secure_coordinator(pki, hostile_config()) as coordinator:
        a = pki.client(coordinator.target, "site-a")
        a.join()
        push = a.channel.stream_unary("/geodiloco.v1.OuterSync/PushDelta")
        as_bytes = st.one_of(st.binary(max_size=300), deltas.map(lambda m: m.SerializeToString()))

        @settings(max_examples=60, deadline=None, database=None)
        @given(stream=st.lists(as_bytes, min_size=1, max_size=4))
        def one_stream(stream: list[bytes]) -> None:
            try:
                push(iter(stream), timeout=10)
            except grpc.RpcError as exc:
                assert exc.code() in ALLOWED, (exc.code(), exc.details())
            assert coordinator.controller.round == 0 and not coordinator.controller.mean.contributors

        one_stream()
        ctl = coordinator.controller
        assert state_hash(ctl.theta) == ctl.hashes[0]
        assert a.join().round == 0  # still serving (the fuzzing may outlast a lease on a slow machine)
