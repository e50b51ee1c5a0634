"""The site's side: the coordinator cannot see one site's update (two runs whose sums agree give
the same unmasked sum, and the bytes that site sent look uniform), and every bad message a site
receives (roster, shares, unmask request) is refused by name."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from geodiloco.security.secagg.messages import Session, ShareInbox, UnmaskRequest
from geodiloco.security.secagg.secagg_errors import Duplicate, InvalidField, WrongPhase, WrongSession
from geodiloco.testing.secagg_rounds import federation

NAMES = ["dc-a", "dc-b", "dc-c", "dc-d"]
NUMEL = 1 << 16
# chi-square critical value for 255 degrees of freedom at a false-alarm rate of 1e-6 (one test
# in a million would refuse truly uniform bytes), by the Wilson-Hilferty approximation
Z_1E6 = 4.753
DOF = 255
CRITICAL = DOF * (1 - 2 / (9 * DOF) + Z_1E6 * math.sqrt(2 / (9 * DOF))) ** 3


def chi_square(data: bytes) -> float:
    counts = np.bincount(np.frombuffer(data, dtype=np.uint8), minlength=256)
    expected = len(data) / 256
    return float(((counts - expected) ** 2 / expected).sum())


def test_one_sites_update_is_hidden_from_the_coordinator() -> None:
    rng = np.random.default_rng(7)
    base = {n: rng.integers(-60, 61, NUMEL, dtype=np.int8) for n in NAMES}
    shift = rng.integers(-60, 61, NUMEL, dtype=np.int8)
    other = dict(base, **{"dc-a": base["dc-a"] + shift, "dc-b": base["dc-b"] - shift})  # same sum
    sums, sent = [], []
    for run, codes in enumerate((base, other)):
        fed = federation(NAMES, NUMEL, seed=run)
        sent.append(b"".join(c.payload for c in fed.push("dc-a", codes["dc-a"], [12345])))
        for n in NAMES[1:]:
            fed.push(n, codes[n], [])
        sums.append(fed.finish().codes)
    assert np.array_equal(sums[0], sums[1])
    assert not np.array_equal(base["dc-a"], other["dc-a"])
    assert 0 < CRITICAL < 400
    for payload in sent:
        assert chi_square(payload) < CRITICAL
    assert chi_square(base["dc-a"].tobytes()) > 100 * CRITICAL  # the test sees unmasked codes


def test_a_roster_that_is_not_what_the_site_advertised_is_refused() -> None:
    fed = federation(NAMES, 1000)
    roster = fed.coordinator.roster()
    from geodiloco.security.secagg.site_round import SiteRound
    from geodiloco.testing.secagg_rounds import fixed_secrets

    with pytest.raises(InvalidField, match="adverts"):
        SiteRound(roster.session, "dc-a").share(roster)  # its own keys are not in it
    site = SiteRound(roster.session, "dc-b")
    swapped = tuple(site.advertise() if a.site == "dc-b" else a for a in roster.adverts)
    with pytest.raises(InvalidField, match="seed"):  # a graph the coordinator chose, not the keys' hash
        site.share(dataclasses.replace(roster, adverts=swapped))
    twin = SiteRound(roster.session, "dc-b", fixed_secrets(0, "dc-b"))
    with pytest.raises(InvalidField, match="ring_bits"):
        twin.share(dataclasses.replace(roster, ring_bits=9))
    with pytest.raises(WrongSession, match=r"session\.fragment"):
        twin.share(dataclasses.replace(roster, session=Session("run-secagg", 0, 1)))
    with pytest.raises(InvalidField, match="weights"):
        dataclasses.replace(roster, weights=(0.5, 0.5, 0.5, 0.5))
    with pytest.raises(InvalidField, match="majority"):  # one colluder could rebuild its key
        twin.share(dataclasses.replace(roster, threshold=1))
    assert twin.share(roster).sender == "dc-b"  # the true roster still works


def test_shares_replayed_moved_or_altered_are_refused_by_the_site() -> None:
    fed = federation(NAMES, 1000)
    site, coord = fed.sites["dc-a"], fed.coordinator
    inbox = coord.inbox("dc-a")
    fresh = _unreceived(fed, "dc-a")
    first = inbox.shares[0]

    def refused(kind: type, field: str, shares: tuple) -> None:  # type: ignore[type-arg]
        with pytest.raises(kind) as e:
            fresh.receive(dataclasses.replace(inbox, shares=shares))
        assert e.value.field == field, e.value

    refused(Duplicate, "shares.sender", (*inbox.shares, first))  # a replayed share
    refused(WrongSession, "session.round", (dataclasses.replace(first, session=Session("run-secagg", 1, 0)),))
    flipped = bytes([first.ciphertext[0] ^ 1]) + first.ciphertext[1:]
    refused(InvalidField, "shares.ciphertext", (dataclasses.replace(first, ciphertext=flipped),))
    moved = next(s for s in coord.inbox("dc-b").shares if s.sender != "dc-a")
    refused(InvalidField, "shares.receiver", (moved,))
    refused(InvalidField, "shares", inbox.shares[1:])  # one neighbour's share is missing
    with pytest.raises(WrongPhase, match="already received"):
        site.receive(inbox)
    fresh.receive(inbox)  # the good inbox still works after every refusal
    assert fresh.masker().terms == site.masker().terms


def _unreceived(fed, name: str):  # type: ignore[no-untyped-def]
    """A second SiteRound with the same secrets, shared but not yet given its inbox: the roster
    and the shares the coordinator routes are the ones the first one's bundle produced."""
    from geodiloco.security.secagg.site_round import SiteRound
    from geodiloco.testing.secagg_rounds import fixed_secrets

    twin = SiteRound(fed.coordinator.session, name, fixed_secrets(0, name))
    twin.share(fed.coordinator.roster())
    return twin


def test_unmask_requests_the_site_must_not_answer() -> None:
    fed = federation(NAMES, 1000)
    site = fed.sites["dc-a"]
    session = fed.coordinator.session
    with pytest.raises(WrongPhase, match="not a survivor"):
        site.reveal(UnmaskRequest(session, ("dc-b", "dc-c"), ("dc-a", "dc-d")))
    first = UnmaskRequest(session, ("dc-a", "dc-b", "dc-c"), ("dc-d",))
    reveal = site.reveal(first)
    assert [(s.owner, s.kind) for s in reveal.shares] == [("dc-d", "mask_key")]
    assert site.reveal(first) == reveal  # a retry gets the same answer
    with pytest.raises(Duplicate, match="request"):  # never a second set: no site's key and self-mask both
        site.reveal(UnmaskRequest(session, ("dc-a", "dc-b"), ("dc-c", "dc-d")))
    with pytest.raises(InvalidField, match="dropped"):
        UnmaskRequest(session, ("dc-a",), ("dc-a",))
    with pytest.raises(WrongPhase, match="sits this one out"):
        _unreceived(fed, "dc-b").receive(ShareInbox(session, "dc-b", (), ("dc-a", "dc-c")))
