"""A whole push through intake, without a server: one call in, one outcome out (or a refusal),
and nothing of a refused push reaches the round's sum."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import pytest
import torch

from geodiloco.coordinator.fragment_rounds import FragmentedController
from geodiloco.coordinator.intake import Pushes, PushOutcome
from geodiloco.coordinator.journal import Journal
from geodiloco.coordinator.refusals import AlreadyAccepted, FailedPrecondition, InvalidArgument
from geodiloco.coordinator.round_metrics import CoordinatorMetrics
from geodiloco.coordinator.rounds import KEEP_DIGESTS, RoundController
from geodiloco.exchange import PushPart, WireChunk
from geodiloco.segment import Segment
from geodiloco.testing.configs import tiny_config
from geodiloco.v1 import outer_sync_pb2
from geodiloco.wire import push_messages

N = 1000
CHUNK = 300


def pushes(**overrides: object) -> tuple[Pushes, RoundController]:
    cfg = tiny_config(**{"round_timeout_s": 60.0, "limits__max_delta_norm_ratio": 0.0, **overrides})
    c = RoundController(cfg, torch.zeros(N), [1000] * cfg.data.shards)
    run = FragmentedController.single(c)
    return Pushes(run, None, CoordinatorMetrics(c), Journal(None)), c


def messages(
    c: RoundController, site: str, round_: int, delta: torch.Tensor, part: int = 0, parts: int = 1
) -> list[outer_sync_pb2.DeltaChunk]:
    """Part ``part`` of ``parts`` of a push of ``delta`` (every ``parts``-th chunk), naming the
    data the ledger reserved for the site."""
    codec = c.uplink
    chunks = [
        WireChunk(Segment(s, 1, min(CHUNK, N - s), min(CHUNK, N - s)), codec.encode(delta[s : s + CHUNK]))
        for s in range(0, N, CHUNK)
    ][part::parts]
    out = []
    for head, payload in push_messages(
        "", site, PushPart(0, round_, codec.spec, chunks, 100, c.data_for(site), part, parts)
    ):
        head.payload = payload
        out.append(head)
    return out


async def stream(msgs: Sequence[outer_sync_pb2.DeltaChunk]) -> AsyncIterator[outer_sync_pb2.DeltaChunk]:
    for m in msgs:
        yield m


def size(site: str, chunk: outer_sync_pb2.DeltaChunk) -> int:
    return chunk.ByteSize()


async def joined(**overrides: object) -> tuple[Pushes, RoundController]:
    p, c = pushes(**overrides)
    for name in c.cfg.sites:
        await c.join(name, "")
    return p, c


async def test_the_parts_of_a_push_come_to_one_accepted_contribution() -> None:
    p, c = await joined()
    delta = torch.randn(N) * 1e-3
    first = await p.receive("site-a", stream(messages(c, "site-a", 0, delta, 0, 2)), size)
    assert first.outcome is PushOutcome.PART and not c.mean.contributors
    second = await p.receive("", stream(messages(c, "site-a", 0, delta, 1, 2)), size)
    assert second.outcome is PushOutcome.ACCEPTED and c.mean.contributors == ["site-a"]
    assert second.payload_bytes == sum(len(m.payload) for m in messages(c, "site-a", 0, delta, 1, 2))


async def test_an_identical_repeat_is_a_duplicate_and_another_push_is_refused() -> None:
    p, c = await joined()
    delta = torch.randn(N) * 1e-3
    assert (
        await p.receive("", stream(messages(c, "site-a", 0, delta)), size)
    ).outcome is PushOutcome.ACCEPTED
    again = await p.receive("", stream(messages(c, "site-a", 0, delta)), size)
    assert again.outcome is PushOutcome.DUPLICATE
    total = c.mean.total.clone()
    with pytest.raises(AlreadyAccepted, match="already accepted"):
        await p.receive("", stream(messages(c, "site-a", 0, delta * 2)), size)
    assert torch.equal(c.mean.total, total) and c.mean.contributors == ["site-a"]


@pytest.mark.parametrize(
    ("opener", "edit", "refusal", "words"),
    [
        ("site-b", None, InvalidArgument, "opened as site 'site-b'"),
        ("", "fragment", InvalidArgument, "fragment 3 does not exist"),
        ("", "codec", InvalidArgument, "is not this run's uplink codec"),
        ("", "tokens", InvalidArgument, "tokens must be in"),
    ],
)
async def test_a_refused_push_changes_nothing(
    opener: str, edit: str | None, refusal: type[Exception], words: str
) -> None:
    p, c = await joined()
    msgs = messages(c, "site-a", 0, torch.randn(N) * 1e-3)
    if edit == "fragment":
        msgs[0].header.fragment = 3
    elif edit == "codec":
        for m in msgs:
            m.header.codec = "q4"
    elif edit == "tokens":
        msgs[0].tokens = 0
    with pytest.raises(refusal, match=words):
        await p.receive(opener, stream(msgs), size)
    assert not c.mean.contributors and not bool(c.mean.total.any())
    assert not p.intakes[0].staged


async def test_an_empty_push_is_refused() -> None:
    p, _ = await joined()
    with pytest.raises(InvalidArgument, match="empty push"):
        await p.receive("", stream([]), size)


async def test_a_push_older_than_the_kept_digests_is_refused_not_acknowledged() -> None:
    p, c = await joined(rounds=KEEP_DIGESTS + 4)
    delta = torch.randn(N) * 1e-3
    sent = {}
    for r in range(KEEP_DIGESTS + 2):
        for name in c.cfg.sites:
            sent[name, r] = messages(c, name, r, delta)
            outcome = await p.receive("", stream(sent[name, r]), size)
            assert outcome.outcome is PushOutcome.ACCEPTED
    kept = c.round - KEEP_DIGESTS
    assert (await p.receive("", stream(sent["site-a", kept]), size)).outcome is PushOutcome.DUPLICATE
    with pytest.raises(FailedPrecondition, match="no longer kept"):
        await p.receive("", stream(sent["site-a", 0]), size)
