"""A repeated push is a duplicate only when identical to the one accepted (real gRPC, loopback)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
import torch

from geodiloco.compression import encode_chunks, envelope, parse_pipeline
from geodiloco.site.edge.client import OuterSyncClient, delta_messages
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.servers import CoordinatorThread
from geodiloco.v1 import outer_sync_pb2_grpc

pytestmark = pytest.mark.integration

CODEC = "fp32"  # so a NaN reaches the coordinator as a NaN


def messages(client: OuterSyncClient, round_: int, delta: torch.Tensor, parts: int = 1) -> list[list[Any]]:
    """One list of messages per part; part p holds every parts-th chunk run of the vector."""
    chunks, _ = encode_chunks(parse_pipeline(CODEC), delta, 1000, round_=round_)
    cut = [len(chunks) * p // parts for p in range(parts + 1)]
    return [
        delta_messages(
            client.run_id,
            client.site,
            round_,
            CODEC,
            chunks[cut[p] : cut[p + 1]],
            100,
            client.assigned,
            p,
            parts,
        )
        for p in range(parts)
    ]


def state(c: CoordinatorThread) -> tuple[Any, ...]:
    ctl = c.controller
    return (
        ctl.round,
        sorted(ctl.mean.contributors),
        ctl.mean.weight,
        ctl.sites["site-a"].accepted,
        ctl.theta.clone(),
        len(ctl.history),
    )


def same(before: tuple[Any, ...], after: tuple[Any, ...]) -> bool:
    return before[:4] == after[:4] and torch.equal(before[4], after[4]) and before[5] == after[5]


def refused(stub: Any, msgs: list[Any], round_: int) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.PushDelta(iter(msgs), timeout=10)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS, err.value.details()
    assert f"a different push for round {round_}" in err.value.details()
    assert "already accepted" in err.value.details()


def variants(client: OuterSyncClient, round_: int, delta: torch.Tensor) -> dict[str, list[Any]]:
    """Pushes for the same round that differ from ``delta``'s."""
    other = messages(client, round_, delta + 1e-3)[0]
    nan = messages(client, round_, delta)[0]
    values = torch.zeros(nan[0].header.numel)
    values[5] = float("nan")
    # a well-formed fp32 frame around a NaN: the site's encoder would refuse it
    nan[0].payload = envelope.seal(parse_pipeline(CODEC).tag, values.numel(), values.numpy().tobytes())
    garbage = messages(client, round_, delta)[0]
    garbage[1].payload = bytes(len(garbage[1].payload))
    tokens = messages(client, round_, delta)[0]
    for m in tokens:
        m.tokens = 99
    return {"other": other, "nan": nan, "garbage": garbage, "tokens": tokens}


def test_only_an_identical_repeat_is_a_duplicate() -> None:
    cfg = tiny_config(min_sites=1, round_timeout_s=60.0, compression__uplink=CODEC)
    with CoordinatorThread(cfg) as c:
        n = c.controller.num_params
        a, b = OuterSyncClient(c.target, "site-a"), OuterSyncClient(c.target, "site-b")
        a.join(), b.join()  # site-b live: round 0 stays open after site-a's push
        stub = outer_sync_pb2_grpc.OuterSyncStub(a.channel)
        delta = torch.randn(n) * 1e-3
        push = messages(a, 0, delta)[0]
        assert len(push) > 2
        assert not stub.PushDelta(iter(push), timeout=10).duplicate
        before = state(c)
        assert stub.PushDelta(iter(messages(a, 0, delta)[0]), timeout=10).duplicate  # a fresh retry
        for name, msgs in variants(a, 0, delta).items():
            refused(stub, msgs, 0)
            assert same(before, state(c)), name

        b_delta = torch.randn(n) * 1e-3
        b_stub = outer_sync_pb2_grpc.OuterSyncStub(b.channel)
        assert not b_stub.PushDelta(iter(messages(b, 0, b_delta)[0]), timeout=10).duplicate
        assert c.controller.round == 1  # closed: site-a's digest for round 0 is still kept
        before = state(c)
        assert stub.PushDelta(iter(messages(a, 0, delta)[0]), timeout=10).duplicate
        for name, msgs in variants(a, 0, delta).items():
            refused(stub, msgs, 0)
            assert same(before, state(c)), name
        assert c.controller.sites["site-a"].rejected == 8


def test_a_repeated_part_is_compared_before_the_contribution_completes() -> None:
    cfg = tiny_config(min_sites=1, sites=["site-a"], round_timeout_s=60.0, compression__uplink=CODEC)
    with CoordinatorThread(cfg) as c:
        n = c.controller.num_params
        a = OuterSyncClient(c.target, "site-a")
        a.join()
        stub = outer_sync_pb2_grpc.OuterSyncStub(a.channel)
        delta = torch.randn(n) * 1e-3
        part0, part1 = messages(a, 0, delta, parts=2)
        assert stub.PushDelta(iter(part0), timeout=10).duplicate is False
        assert stub.PushDelta(iter(messages(a, 0, delta, parts=2)[0]), timeout=10).duplicate
        other = messages(a, 0, delta * 2, parts=2)[0]
        refused(stub, other, 0)
        assert c.controller.round == 0 and not c.controller.mean.contributors
        assert not stub.PushDelta(iter(part1), timeout=10).duplicate  # completes the contribution
        assert c.controller.round == 1 and c.controller.history[0].contributors == ["site-a"]
        refused(stub, messages(a, 0, delta * 2, parts=2)[1], 0)  # after acceptance: per part
        assert stub.PushDelta(iter(messages(a, 0, delta, parts=2)[1]), timeout=10).duplicate


def test_a_rejoined_site_pushes_its_round_afresh() -> None:
    """A site whose lease lapsed mid-push rejoins and trains the round again: the part it had
    pushed before is forgotten, so the new push is neither refused nor mixed with the old one
    (θ_1 is what the retrained push alone gives)."""
    cfg = tiny_config(min_sites=1, sites=["site-a"], round_timeout_s=60.0, compression__uplink=CODEC)
    thetas = []
    for abandoned_first in (True, False):
        with CoordinatorThread(cfg) as c:
            n = c.controller.num_params
            gen = torch.Generator().manual_seed(1)
            first, retrained = torch.randn(n, generator=gen) * 1e-3, torch.randn(n, generator=gen) * 1e-3
            a = OuterSyncClient(c.target, "site-a")
            a.join()
            stub = outer_sync_pb2_grpc.OuterSyncStub(a.channel)
            if abandoned_first:
                assert not stub.PushDelta(iter(messages(a, 0, first, parts=2)[1]), timeout=10).duplicate
                a.join()  # the rejoin: the site starts round 0 over
            for part in messages(a, 0, retrained, parts=2):
                assert not stub.PushDelta(iter(part), timeout=10).duplicate
            assert c.controller.round == 1
            thetas.append(c.controller.theta.clone())
    assert torch.equal(thetas[0], thetas[1])


def test_digests_are_kept_for_a_few_closed_rounds_only() -> None:
    from geodiloco.coordinator.rounds import KEEP_DIGESTS

    cfg = tiny_config(min_sites=1, sites=["site-a"], rounds=KEEP_DIGESTS + 3, compression__uplink=CODEC)
    with CoordinatorThread(cfg) as c:
        n = c.controller.num_params
        a = OuterSyncClient(c.target, "site-a")
        a.join()
        stub = outer_sync_pb2_grpc.OuterSyncStub(a.channel)
        for r in range(KEEP_DIGESTS + 2):
            a.join()  # this round's data
            stub.PushDelta(iter(messages(a, r, torch.randn(n) * 1e-3)[0]), timeout=10)
        assert c.controller.round == KEEP_DIGESTS + 2
        assert sorted(r for _, r in c.controller.push_digests) == list(range(2, KEEP_DIGESTS + 2))
