"""Which failed calls a site repeats (issue 16 item 6): a coordinator that went away mid-call,
whatever status its dying process left (UNKNOWN, CANCELLED, a transport INTERNAL), is retried,
for a bounded time; a refusal it meant is raised at once.

A real gRPC server on loopback answers Join with a scripted sequence of statuses, exactly as
they cross the wire; the whole coordinator dying by an exception is in the chaos tests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from geodiloco.site.edge.client import OuterSyncClient
from geodiloco.v1 import outer_sync_pb2

OK = None


class ScriptedJoin:
    """A gRPC server whose Join fails with the scripted (code, details) in turn, then succeeds."""

    def __init__(self, script: list[tuple[grpc.StatusCode, str] | None], forever: bool = False) -> None:
        self.script, self.forever, self.calls = list(script), forever, 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        handler = grpc.unary_unary_rpc_method_handler(
            self.join,
            request_deserializer=outer_sync_pb2.JoinRequest.FromString,
            response_serializer=outer_sync_pb2.JoinResponse.SerializeToString,
        )
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("geodiloco.v1.OuterSync", {"Join": handler}),)
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def join(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.calls += 1
        step = self.script[0] if self.forever else (self.script.pop(0) if self.script else OK)
        if step is not OK:
            context.abort(*step)
        config = json.dumps({"round_timeout_s": 77.0})
        return outer_sync_pb2.JoinResponse(run_id="r", run_config_json=config, round=3)

    def client(self, **kwargs: Any) -> OuterSyncClient:
        return OuterSyncClient(f"127.0.0.1:{self.port}", "site-a", **kwargs)


@pytest.fixture
def scripted() -> Iterator[list[ScriptedJoin]]:
    made: list[ScriptedJoin] = []
    yield made
    for server in made:
        server.server.stop(0)


LOST_CALLS = [
    (grpc.StatusCode.UNKNOWN, "Unexpected <class 'geodiloco.faults.InjectedCrash'>"),
    (grpc.StatusCode.CANCELLED, "CANCELLED"),
    (grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
]


def test_calls_lost_to_a_dying_coordinator_are_retried_until_it_answers(scripted: list[ScriptedJoin]) -> None:
    server = ScriptedJoin(LOST_CALLS)
    scripted.append(server)
    client = server.client(max_attempts=8)
    info = client.join()
    assert info.round == 3 and server.calls == len(LOST_CALLS) + 1
    assert client.patience_s == 77.0  # the run's own patience (round_timeout_s), learned at Join
    client.close()


@pytest.mark.parametrize(
    "refusal",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, "run_id 'x' is not this run"),
        (grpc.StatusCode.PERMISSION_DENIED, "site 'site-a' is not part of run 'r'"),
        (grpc.StatusCode.FAILED_PRECONDITION, "the secret of site-a does not match"),
        (grpc.StatusCode.INTERNAL, "a coordinator error with a reason"),  # said by the coordinator
        (grpc.StatusCode.UNKNOWN, "Exception iterating requests!"),  # our own request stream raised
    ],
)
def test_refusals_are_raised_at_once(
    scripted: list[ScriptedJoin], refusal: tuple[grpc.StatusCode, str]
) -> None:
    server = ScriptedJoin([refusal])
    scripted.append(server)
    client = server.client()
    with pytest.raises(grpc.RpcError) as err:
        client.join()
    assert (err.value.code(), err.value.details()) == refusal
    assert server.calls == 1
    client.close()


def test_retries_are_bounded_by_attempts_and_patience(scripted: list[ScriptedJoin]) -> None:
    server = ScriptedJoin([(grpc.StatusCode.UNKNOWN, "boom")], forever=True)
    scripted.append(server)
    client = server.client(max_attempts=3, patience_s=0.0)
    with pytest.raises(grpc.RpcError) as err:
        client.join()
    assert err.value.code() == grpc.StatusCode.UNKNOWN and server.calls == 3
    server.calls = 0
    patient = server.client(max_attempts=1, patience_s=1.0)  # backoff 0.1-0.3 s, 0.2-0.6 s, ...
    with pytest.raises(grpc.RpcError):
        patient.join()
    assert 2 <= server.calls <= 6
    client.close(), patient.close()
