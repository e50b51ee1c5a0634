"""One secure aggregation driven in process, message by message, as a transport would carry it:
the set-up tests and ``benchmarks/secagg.py`` share. Keys come from a seed, so runs repeat."""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass

import numpy as np

from geodiloco.security.secagg.coordinator_round import AggregateSum, CoordinatorRound, SecAggConfig
from geodiloco.security.secagg.messages import MaskedChunk, Session
from geodiloco.security.secagg.site_round import SiteRound, SiteSecrets


def fixed_secrets(seed: int, site: str) -> SiteSecrets:
    """Deterministic secrets for ``site``: SHA-256 of the seed, the site and a label."""
    parts = (
        hashlib.sha256(f"{seed}/{site}/{label}".encode()).digest() for label in ("mask", "share", "self")
    )
    return SiteSecrets(*parts)


@dataclass
class Federation:
    """A coordinator and its sites after the key phases (adverts, roster, shares, inboxes)."""

    coordinator: CoordinatorRound
    sites: dict[str, SiteRound]

    def push(self, site: str, codes: np.ndarray, bounds: list[int], start: int = 0) -> list[MaskedChunk]:
        """Mask ``codes`` (elements [start, start + len)) in chunks cut at ``bounds`` (offsets into
        ``codes``) and push them."""
        cuts = [0, *bounds, codes.size]
        site_round = self.sites[site]
        chunks = [site_round.mask(codes[a:b], start + a) for a, b in itertools.pairwise(cuts) if b > a]
        for c in chunks:
            self.coordinator.receive_push(c)
        return chunks

    def finish(self) -> AggregateSum:
        """Close the pushes, collect every survivor's reveal, unmask."""
        request = self.coordinator.close_pushes()
        for s in request.survivors:
            self.coordinator.receive_reveal(self.sites[s].reveal(request))
        return self.coordinator.unmask()


def federation(
    names: list[str],
    numel: int,
    config: SecAggConfig | None = None,
    tokens: dict[str, int] | None = None,
    seed: int = 0,
    session: Session | None = None,
) -> Federation:
    session = session or Session("run-secagg", 0, 0)
    tokens = tokens or {n: 1000 for n in names}
    coordinator = CoordinatorRound(
        session,
        tokens,
        numel,
        config or SecAggConfig(),
    )
    sites = {n: SiteRound(session, n, fixed_secrets(seed, n)) for n in names}
    for s in sites.values():
        coordinator.receive_advert(s.advertise())
    roster = coordinator.roster()
    for s in sites.values():
        coordinator.receive_shares(s.share(roster))
    for n, s in sites.items():
        s.receive(coordinator.inbox(n))
    return Federation(coordinator, sites)
