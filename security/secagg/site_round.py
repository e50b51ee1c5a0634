"""A site's side of one secure aggregation, as a state machine over :mod:`.messages`.

advertise → share(roster) → receive(inbox) → propose / quantise → mask (any chunks, any ranks:
:meth:`SiteRound.masker` is what a site's ranks need) → reveal(unmask request). Keys are fresh
per session, so a mask key revealed to recover a lost site says nothing of another round.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from geodiloco.security.secagg import mask_keys, ring, shamir, shared_scale
from geodiloco.security.secagg.messages import (
    EncryptedShare,
    KeyAdvert,
    MaskedChunk,
    Reveal,
    RevealedShare,
    Roster,
    ScalePlan,
    ScaleProposal,
    Session,
    ShareBundle,
    ShareInbox,
    UnmaskRequest,
)
from geodiloco.security.secagg.neighbours import default_threshold, graph, graph_seed
from geodiloco.security.secagg.secagg_errors import Duplicate, InvalidField, WrongPhase

NONCE = 12


def share_aad(session: Session, sender: str, receiver: str) -> bytes:
    return b"\x00".join((b"geodiloco secagg share", session.context, sender.encode(), receiver.encode()))


@dataclass(slots=True)
class Masker:
    """What masking needs and nothing else: the pair seeds with signs (and the self-mask seed).
    A site hands it to each of its ranks, which mask their own shards."""

    session: Session
    site: str
    ring_bits: int
    terms: list[tuple[bytes, int]]
    buffer: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint16))
    packed: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint8))

    def mask(self, codes: np.ndarray, start: int) -> MaskedChunk:
        """The masked push of int8 ``codes`` of elements [start, start + len(codes))."""
        if codes.dtype != np.int8 or codes.ndim != 1 or not codes.size:
            raise InvalidField("codes", "must be a non-empty 1-D int8 array")
        if self.buffer.size < codes.size:  # reused: a fresh multi-MB array costs its page faults
            self.buffer = np.empty(codes.size, dtype=np.uint16)
            self.packed = np.empty(ring.packed_size(codes.size, self.ring_bits), dtype=np.uint8)
        m = mask_keys.masks(codes.size, start, self.terms, out=self.buffer[: codes.size])
        payload = ring.pack(m, codes, self.ring_bits, out=self.packed).tobytes()
        return MaskedChunk(self.session, self.site, start, codes.size, self.ring_bits, payload)


@dataclass(frozen=True, slots=True)
class SiteSecrets:
    """A site's secrets for one session: two X25519 private keys and the self-mask seed."""

    mask_key: bytes
    share_key: bytes
    self_seed: bytes

    @staticmethod
    def fresh() -> SiteSecrets:
        return SiteSecrets(*(os.urandom(mask_keys.KEY_BYTES) for _ in range(3)))

    def __repr__(self) -> str:
        return "SiteSecrets(...)"  # never in a log


class SiteRound:
    def __init__(self, session: Session, site: str, secrets: SiteSecrets | None = None) -> None:
        """``secrets``: fresh random ones unless given (tests give fixed ones, to be deterministic)."""
        secrets = secrets or SiteSecrets.fresh()
        self.session = session
        self.site = site
        self._mask_key = mask_keys.load_private(secrets.mask_key)
        self._share_key = mask_keys.load_private(secrets.share_key)
        self._self_seed = secrets.self_seed
        self._advert = KeyAdvert(
            session, site, mask_keys.public_bytes(self._mask_key), mask_keys.public_bytes(self._share_key)
        )
        self.roster: Roster | None = None
        self.neighbours: tuple[str, ...] = ()
        self._held: dict[str, tuple[bytes, bytes | None]] = {}  # owner -> (mask-key share, self-mask share)
        self._masker: Masker | None = None
        self._answered: tuple[UnmaskRequest, Reveal] | None = None

    def advertise(self) -> KeyAdvert:
        return self._advert

    def _roster(self) -> Roster:
        if self.roster is None:
            raise WrongPhase("roster", "no roster yet: call share(roster) first")
        return self.roster

    def share(self, roster: Roster) -> ShareBundle:
        """Check the roster, then split this site's secrets among its neighbours, encrypted to each."""
        if self.roster is not None:
            raise WrongPhase("roster", "this site already shared its keys for the session")
        self.session.expect(roster.session)
        if roster.advert(self.site) != self._advert:
            raise InvalidField(
                "adverts", f"the roster's keys for {self.site!r} are not the ones it advertised"
            )
        keys = [(a.site, a.mask_key, a.share_key) for a in roster.adverts]
        if roster.seed != graph_seed(self.session.context, keys):
            raise InvalidField("seed", "is not the hash of the session and the advertised keys")
        if roster.ring_bits != ring.ring_bits(len(roster.sites)):
            raise InvalidField(
                "ring_bits", f"{roster.ring_bits} bits cannot hold {len(roster.sites)} sites' sum"
            )
        if roster.threshold < default_threshold(roster.degree):
            raise InvalidField(
                "threshold", f"{roster.threshold} of {roster.degree} neighbours: must be a majority"
            )
        self.roster = roster
        self.neighbours = graph(roster.sites, roster.seed, roster.degree)[self.site]
        points = [roster.point(n) for n in self.neighbours]
        mask_shares = shamir.split(mask_keys.private_bytes(self._mask_key), points, roster.threshold)
        self_shares = shamir.split(self._self_seed, points, roster.threshold) if roster.self_masks else None
        shares = []
        for n, x in zip(self.neighbours, points, strict=True):
            plain = x.to_bytes(2, "big") + mask_shares[x] + (self_shares[x] if self_shares else b"")
            shared = mask_keys.agree(self._share_key, roster.advert(n).share_key, "adverts.share_key")
            key = mask_keys.share_key(shared, self.session.context, self.site, n)
            nonce = os.urandom(NONCE)
            sealed = AESGCM(key).encrypt(nonce, plain, share_aad(self.session, self.site, n))
            shares.append(EncryptedShare(self.session, self.site, n, nonce, sealed))
        return ShareBundle(self.session, self.site, tuple(shares))

    def receive(self, inbox: ShareInbox) -> None:
        """Open the neighbours' shares and derive the pair masks with the cohort."""
        roster = self._roster()
        if self._masker is not None:
            raise WrongPhase("inbox", "this site already received its shares for the session")
        self.session.expect(inbox.session)
        if inbox.receiver != self.site:
            raise InvalidField("receiver", f"{inbox.receiver!r}, this is {self.site!r}")
        unknown = set(inbox.cohort) - set(roster.sites)
        if unknown:
            raise InvalidField("cohort", f"names sites not in the roster: {sorted(unknown)}")
        if self.site not in inbox.cohort:
            raise WrongPhase("cohort", f"{self.site!r}'s shares did not arrive in time: it sits this one out")
        expected = self._share_size(roster)
        held: dict[str, tuple[bytes, bytes | None]] = {}
        for s in inbox.shares:
            self.session.expect(s.session)
            if s.receiver != self.site:
                raise InvalidField("shares.receiver", f"{s.receiver!r}, this is {self.site!r}")
            if s.sender not in self.neighbours or s.sender not in inbox.cohort:
                raise InvalidField("shares.sender", f"{s.sender!r} is not a neighbour in the cohort")
            if s.sender in held:
                raise Duplicate("shares.sender", f"a second share from {s.sender!r}")
            shared = mask_keys.agree(self._share_key, roster.advert(s.sender).share_key, "adverts.share_key")
            key = mask_keys.share_key(shared, self.session.context, s.sender, self.site)
            try:
                plain = AESGCM(key).decrypt(
                    s.nonce, s.ciphertext, share_aad(self.session, s.sender, self.site)
                )
            except InvalidTag:
                raise InvalidField(
                    "shares.ciphertext", f"the share from {s.sender!r} fails its tag"
                ) from None
            if len(plain) != expected or int.from_bytes(plain[:2], "big") != roster.point(self.site):
                raise InvalidField("shares.ciphertext", f"the share from {s.sender!r} is not for this site")
            y = plain[2 : 2 + shamir.SHARE_BYTES]
            held[s.sender] = (y, plain[2 + shamir.SHARE_BYTES :] or None)
        missing = [n for n in self.neighbours if n in inbox.cohort and n not in held]
        if missing:
            raise InvalidField("shares", f"no share from the neighbour(s) {missing}")
        self._held = held
        terms = []
        for n in self.neighbours:
            if n in inbox.cohort:
                shared = mask_keys.agree(self._mask_key, roster.advert(n).mask_key, "adverts.mask_key")
                seed = mask_keys.pair_seed(shared, self.session.context, self.site, n)
                terms.append((seed, 1 if self.site < n else -1))
        if roster.self_masks:
            terms.append((self._self_seed, 1))
        self._masker = Masker(self.session, self.site, roster.ring_bits, terms)

    @staticmethod
    def _share_size(roster: Roster) -> int:
        return 2 + shamir.SHARE_BYTES * (2 if roster.self_masks else 1)

    @property
    def weight(self) -> float:
        """This site's normalised weight: Δ is multiplied by it before quantising."""
        return self._roster().weight(self.site)

    def propose(self, parts: list[tuple[int, torch.Tensor]]) -> ScaleProposal:
        """The per-block exponents of the weighted Δ, from (start, values) parts (a rank's shard each)."""
        roster = self._roster()
        q = np.full(shared_scale.n_blocks(roster.numel, roster.block), shared_scale.ZERO, dtype=np.int16)
        for start, x in parts:
            first, own = shared_scale.propose(x * self.weight, start, roster.block)
            shared_scale.merge(q, first, own)
        return ScaleProposal(self.session, self.site, q)

    def quantise(self, x: torch.Tensor, start: int, plan: ScalePlan) -> np.ndarray:
        roster = self._roster()
        self.session.expect(plan.session)
        if plan.exponents.size != shared_scale.n_blocks(roster.numel, roster.block):
            raise InvalidField("exponents", f"{plan.exponents.size} blocks, the vector has another count")
        return shared_scale.quantise(x * self.weight, start, roster.block, plan.exponents)

    def masker(self) -> Masker:
        if self._masker is None:
            raise WrongPhase("inbox", "no shares received yet: call receive(inbox) first")
        return self._masker

    def mask(self, codes: np.ndarray, start: int) -> MaskedChunk:
        if start + codes.size > self._roster().numel:
            raise InvalidField("start", f"elements past the vector's {self._roster().numel}")
        return self.masker().mask(codes, start)

    def reveal(self, request: UnmaskRequest) -> Reveal:
        """The shares the coordinator needs: of dropped neighbours' mask keys and (self-masks on)
        of surviving neighbours' self-masks; never both kinds of one site, never a second answer."""
        self.session.expect(request.session)
        self.masker()
        if self._answered is not None:
            if self._answered[0] != request:
                raise Duplicate("request", "a second, different unmask request for this session")
            return self._answered[1]
        if self.site not in request.survivors:
            raise WrongPhase("survivors", f"{self.site!r} is not a survivor: it reveals nothing")
        shares = []
        for owner, (mask_y, self_y) in sorted(self._held.items()):
            if owner in request.dropped:
                shares.append(RevealedShare(owner, "mask_key", mask_y))
            elif owner in request.survivors and self_y is not None:
                shares.append(RevealedShare(owner, "self_mask", self_y))
        reveal = Reveal(self.session, self.site, tuple(shares))
        self._answered = (request, reveal)
        return reveal
