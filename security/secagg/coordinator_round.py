"""The coordinator's side of one secure aggregation: it routes keys and shares, takes masked
pushes, fixes who survived, collects the survivors' reveals and unmasks the sum. It never holds
a site's update in the clear: only the sum of the survivors' codes.

Each ``receive_*`` checks a message against the roster and the phase and raises a
:class:`~.secagg_errors.SecAggError` (nothing changed) or records it; an identical repeat is a
no-op, so a retried call changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from geodiloco.security.secagg import mask_keys, ring, shamir, shared_scale
from geodiloco.security.secagg.messages import (
    KeyAdvert,
    MaskedChunk,
    Reveal,
    Roster,
    ScalePlan,
    ScaleProposal,
    Session,
    ShareBundle,
    ShareInbox,
    UnmaskRequest,
)
from geodiloco.security.secagg.neighbours import default_degree, default_threshold, graph, graph_seed
from geodiloco.security.secagg.secagg_errors import (
    Duplicate,
    InvalidField,
    RecoveryFailed,
    SecAggError,
    WrongPhase,
)

PHASES = ("adverts", "shares", "pushes", "unmask", "done")


@dataclass(frozen=True, slots=True, kw_only=True)
class SecAggConfig:
    """``degree``: neighbours each site masks with (None: 2·⌈log2 n⌉, capped at n - 1);
    ``threshold``: shares that recover a key (None: a majority of the degree; sites refuse less,
    so that no two disjoint sets of neighbours can each rebuild something); ``self_masks``:
    Bonawitz's self-masks (a late push of a site declared dropped stays hidden; costs the
    coordinator one stream per survivor); ``block``: elements per shared scale."""

    degree: int | None = None
    threshold: int | None = None
    self_masks: bool = False
    block: int = 128

    def __post_init__(self) -> None:
        if self.degree is not None and self.degree < 1:
            raise InvalidField("degree", f"must be >= 1, got {self.degree}")
        if self.threshold is not None and self.threshold < 1:
            raise InvalidField("threshold", f"must be >= 1, got {self.threshold}")
        if not 1 <= self.block <= 1 << 20:
            raise InvalidField("block", f"must be in [1, {1 << 20}], got {self.block}")


@dataclass(frozen=True, slots=True)
class AggregateSum:
    """The unmasked sum of the survivors' codes (int16: it fits the ring) and their total weight:
    the weighted mean is ``shared_scale.dequantise(codes, block, plan.exponents, weight)``."""

    codes: np.ndarray
    survivors: tuple[str, ...]
    weight: float


class CoordinatorRound:
    def __init__(
        self,
        session: Session,
        tokens: dict[str, int],
        numel: int,
        config: SecAggConfig = SecAggConfig(),
    ) -> None:
        """``tokens``: each expected site's tokens from the ledger (its weight, known in advance)."""
        if not tokens or any(t <= 0 for t in tokens.values()):
            raise InvalidField("tokens", "each expected site needs a positive token count")
        if numel < 1:
            raise InvalidField("numel", f"must be >= 1, got {numel}")
        self.session, self.tokens, self.numel, self.config = session, dict(tokens), numel, config
        self.phase = "adverts"
        self._adverts: dict[str, KeyAdvert] = {}
        self._roster: Roster | None = None
        self._graph: dict[str, tuple[str, ...]] = {}
        self._bundles: dict[str, ShareBundle] = {}
        self._cohort: tuple[str, ...] = ()
        self._proposals: dict[str, ScaleProposal] = {}
        self._plan: ScalePlan | None = None
        self._chunks: dict[str, dict[int, MaskedChunk]] = {}
        self._request: UnmaskRequest | None = None
        self._reveals: dict[str, Reveal] = {}

    def _in(self, *phases: str) -> None:
        if self.phase not in phases:
            raise WrongPhase(
                "phase", f"the aggregation is in phase {self.phase!r}, not {' or '.join(phases)}"
            )

    def _member(self, site: str, field: str = "site") -> None:
        if site not in self._cohort:
            if self._roster is not None and site in self._roster.sites:
                raise WrongPhase(field, f"{site!r} sent no shares in time: it is not in this aggregation")
            raise InvalidField(field, f"{site!r} is not in this aggregation")

    # -- keys -----------------------------------------------------------------------------------

    def receive_advert(self, advert: KeyAdvert) -> None:
        self.session.expect(advert.session)
        self._in("adverts")
        if advert.site not in self.tokens:
            raise InvalidField("site", f"{advert.site!r} is not expected in this round")
        held = self._adverts.get(advert.site)
        if held is not None and held != advert:
            raise Duplicate("site", f"{advert.site!r} already advertised other keys")
        self._adverts[advert.site] = advert

    def roster(self) -> Roster:
        """Close the adverts (first call) and publish who takes part and on what terms."""
        if self._roster is None:
            self._in("adverts")
            sites = tuple(sorted(self._adverts))
            if len(sites) < 2:
                raise RecoveryFailed(
                    "adverts", f"{len(sites)} site(s) advertised keys; a sum needs 2 or more"
                )
            degree = min(self.config.degree or default_degree(len(sites)), len(sites) - 1)
            threshold = min(self.config.threshold or default_threshold(degree), degree)
            if threshold < default_threshold(degree):
                raise InvalidField(
                    "threshold", f"{threshold} of {degree} neighbours; at least {default_threshold(degree)}"
                )
            total = sum(self.tokens[s] for s in sites)
            adverts = [self._adverts[s] for s in sites]
            seed = graph_seed(self.session.context, [(a.site, a.mask_key, a.share_key) for a in adverts])
            self._roster = Roster(
                self.session,
                tuple(adverts),
                tuple(self.tokens[s] / total for s in sites),
                seed,
                ring.ring_bits(len(sites)),
                degree,
                threshold,
                self.numel,
                self.config.block,
                self.config.self_masks,
            )
            self._graph = graph(sites, self._roster.seed, self._roster.degree)
            self.phase = "shares"
        return self._roster

    def receive_shares(self, bundle: ShareBundle) -> None:
        self.session.expect(bundle.session)
        self._in("shares")
        roster = self.roster()
        if bundle.sender not in roster.sites:
            raise InvalidField("sender", f"{bundle.sender!r} is not in the roster")
        receivers = sorted(s.receiver for s in bundle.shares)
        if receivers != sorted(self._graph[bundle.sender]):
            raise InvalidField(
                "shares.receiver",
                f"{receivers}, {bundle.sender!r}'s neighbours are {list(self._graph[bundle.sender])}",
            )
        held = self._bundles.get(bundle.sender)
        if held is not None and held != bundle:
            raise Duplicate("sender", f"{bundle.sender!r} already sent other shares")
        self._bundles[bundle.sender] = bundle

    def inbox(self, site: str) -> ShareInbox:
        """The shares for ``site``; the first call closes the share phase (the cohort is fixed)."""
        roster = self.roster()
        if self.phase == "shares":
            self._cohort = tuple(s for s in roster.sites if s in self._bundles)
            self.phase = "pushes"
        self._member(site)
        shares = tuple(
            s for sender in self._cohort for s in self._bundles[sender].shares if s.receiver == site
        )
        return ShareInbox(self.session, site, shares, self._cohort)

    # -- scales and pushes ----------------------------------------------------------------------

    def receive_scales(self, proposal: ScaleProposal) -> None:
        self.session.expect(proposal.session)
        self._in("pushes")
        self._member(proposal.site)
        if self._plan is not None:
            raise WrongPhase("exponents", "the scales are already agreed")
        blocks = shared_scale.n_blocks(self.numel, self.config.block)
        if proposal.exponents.size != blocks:
            raise InvalidField(
                "exponents", f"{proposal.exponents.size} exponents, the vector has {blocks} blocks"
            )
        held = self._proposals.get(proposal.site)
        if held is not None and not np.array_equal(held.exponents, proposal.exponents):
            raise Duplicate("site", f"{proposal.site!r} already proposed other scales")
        self._proposals[proposal.site] = proposal

    def scale_plan(self) -> ScalePlan:
        """The agreed exponents (the largest proposal per block); fixed at the first call."""
        if self._plan is None:
            self._in("pushes")
            if not self._proposals:
                raise WrongPhase("exponents", "no site proposed scales yet")
            q = np.full(
                shared_scale.n_blocks(self.numel, self.config.block), shared_scale.ZERO, dtype=np.int16
            )
            for p in self._proposals.values():
                np.maximum(q, p.exponents, out=q)
            self._plan = ScalePlan(self.session, q)
        return self._plan

    def receive_push(self, chunk: MaskedChunk) -> None:
        self.session.expect(chunk.session)
        self._in("pushes")
        self._member(chunk.site)
        roster = self.roster()
        if chunk.ring_bits != roster.ring_bits:
            raise InvalidField(
                "ring_bits", f"{chunk.ring_bits}, this aggregation's ring has {roster.ring_bits}"
            )
        if chunk.start + chunk.numel > self.numel:
            raise InvalidField(
                "numel", f"elements [{chunk.start}, {chunk.start + chunk.numel}) pass {self.numel}"
            )
        held = self._chunks.setdefault(chunk.site, {})
        if held.get(chunk.start) == chunk:
            return  # a retry
        for other in held.values():
            if chunk.start < other.start + other.numel and other.start < chunk.start + chunk.numel:
                raise Duplicate(
                    "start",
                    f"{chunk.site!r} already pushed elements [{other.start}, {other.start + other.numel})",
                )
        held[chunk.start] = chunk

    def close_pushes(self) -> UnmaskRequest:
        """Fix survivors (whole pushes) and dropped sites; refuse when recovery cannot succeed."""
        if self._request is None:
            self._in("pushes")
            roster = self.roster()
            whole = {s for s, c in self._chunks.items() if sum(x.numel for x in c.values()) == self.numel}
            survivors = tuple(s for s in self._cohort if s in whole)
            dropped = tuple(s for s in self._cohort if s not in whole)
            if len(survivors) < 2:
                raise RecoveryFailed("survivors", f"{len(survivors)} whole push(es); a sum needs 2 or more")
            # a dropped site's key is needed where a surviving neighbour holds masks with it; a
            # survivor's self-mask seed (self-masks on) always
            needy = [(s, False) for s in dropped] + [(s, True) for s in survivors if roster.self_masks]
            for site, always in needy:
                alive = [n for n in self._graph[site] if n in survivors]
                if (always or alive) and len(alive) < roster.threshold:
                    raise RecoveryFailed(
                        "dropped",
                        f"{site!r} has {len(alive)} surviving neighbour(s), "
                        f"the threshold is {roster.threshold}: its masks cannot be removed",
                    )
            self._request = UnmaskRequest(self.session, survivors, dropped)
            self.phase = "unmask"
        return self._request

    # -- unmasking ------------------------------------------------------------------------------

    def receive_reveal(self, reveal: Reveal) -> None:
        self.session.expect(reveal.session)
        self._in("unmask")
        request = self.close_pushes()
        if reveal.site not in request.survivors:
            self._member(reveal.site)
            raise WrongPhase(
                "site", f"{reveal.site!r} sent shares but no whole push: dropped, it reveals nothing"
            )
        held = self._reveals.get(reveal.site)
        if held is not None:
            if held != reveal:
                raise Duplicate("site", f"{reveal.site!r} already revealed other shares")
            return
        self_masks = self.roster().self_masks
        for s in reveal.shares:
            if s.owner not in self._graph[reveal.site] or s.owner not in self._cohort:
                raise InvalidField("shares.owner", f"{s.owner!r} is not a neighbour of {reveal.site!r}")
            wanted = "mask_key" if s.owner in request.dropped else ("self_mask" if self_masks else None)
            if s.kind != wanted:
                raise InvalidField("shares.kind", f"{s.kind!r} for {s.owner!r}, expected {wanted!r}")
        self._reveals[reveal.site] = reveal

    def _recover(self, owner: str, kind: str) -> bytes:
        roster = self.roster()
        found = {
            roster.point(site): s.y
            for site, r in self._reveals.items()
            for s in r.shares
            if s.owner == owner and s.kind == kind
        }
        try:
            return shamir.combine(found, roster.threshold)
        except SecAggError as e:
            raise RecoveryFailed("shares", f"{kind} of {owner!r}: {e}") from None

    def unmask(self, out: np.ndarray | None = None) -> AggregateSum:
        """The survivors' sum of codes: their pushes added in the ring, the masks that did not
        cancel (pairs with dropped sites; self-masks) removed. ``out``: a reused uint16 buffer
        of at least ``numel`` (the result is a view of it). Called again, it computes the same sum."""
        self._in("unmask", "done")
        request, roster = self.close_pushes(), self.roster()
        acc = np.empty(self.numel, dtype=np.uint16) if out is None else out[: self.numel]
        # by span, not by site: the pushes of one span are added tile by tile, in cache
        spans: dict[tuple[int, int], list[bytes]] = {}
        for site in request.survivors:
            for c in self._chunks[site].values():
                spans.setdefault((c.start, c.numel), []).append(c.payload)
        ordered = sorted(spans.items())
        # when the spans tile the vector (every site chunked alike), the first push of each sets
        # the sum and nothing needs zeroing; otherwise spans overlap and all of them add
        tiled, end = True, 0
        for (start, numel), _ in ordered:
            tiled, end = tiled and start == end, start + numel
        if not tiled:
            acc[:] = 0
        for (start, numel), payloads in ordered:
            ring.add_all(acc[start : start + numel], payloads, roster.ring_bits, assign=tiled)
        terms: list[tuple[bytes, int]] = []
        for d in request.dropped:
            if not any(j in request.survivors for j in self._graph[d]):
                continue  # all its neighbours were lost too: none of its masks is in the sum
            raw = self._recover(d, "mask_key")
            key = mask_keys.load_private(raw)
            if mask_keys.public_bytes(key) != roster.advert(d).mask_key:
                raise RecoveryFailed("shares", f"the mask key rebuilt for {d!r} is not the one it advertised")
            for j in self._graph[d]:
                if j in request.survivors:
                    shared = mask_keys.agree(key, roster.advert(j).mask_key, "adverts.mask_key")
                    terms.append(
                        (mask_keys.pair_seed(shared, self.session.context, d, j), -1 if j < d else 1)
                    )
        if roster.self_masks:
            terms += [(self._recover(s, "self_mask"), -1) for s in request.survivors]
        if terms:
            mask_keys.masks(self.numel, 0, terms, out=acc, accumulate=True)
        codes, largest = ring.to_signed(acc, roster.ring_bits)
        bound = ring.CODE_MAX * len(request.survivors)
        if largest > bound:
            raise InvalidField(
                "payload",
                f"the unmasked sum leaves ±{bound}: a push was not masked codes "
                "on the agreed grid (or a mask did not cancel)",
            )
        self.phase = "done"
        weight = sum(roster.weight(s) for s in request.survivors)
        return AggregateSum(codes, request.survivors, weight)
