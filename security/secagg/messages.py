"""The messages of one secure aggregation, as typed values checked on construction: each bad
field raises :class:`~.secagg_errors.InvalidField` naming it. What a message must agree with
(the roster, the phase, earlier messages) the receiving state machine checks.

Order: every site sends a :class:`KeyAdvert`; the coordinator publishes the :class:`Roster`;
each site sends a :class:`ShareBundle` (its key shares, encrypted to its neighbours), and gets
its :class:`ShareInbox`; after training, a :class:`ScaleProposal`, then the :class:`ScalePlan`;
then :class:`MaskedChunk` pushes; the coordinator sends an :class:`UnmaskRequest` naming
survivors and dropped sites, and each survivor answers with a :class:`Reveal`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from geodiloco.security.secagg.mask_keys import KEY_BYTES
from geodiloco.security.secagg.ring import WIDTHS, packed_size
from geodiloco.security.secagg.secagg_errors import InvalidField, WrongSession
from geodiloco.security.secagg.shamir import SHARE_BYTES

MAX_NAME = 128
NONCE_BYTES = 12
TAG_BYTES = 16


def _name(field: str, value: object) -> None:
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_NAME:
        raise InvalidField(field, f"must be a non-empty string of at most {MAX_NAME} characters")


def _raw(field: str, value: object, size: int) -> None:
    if not isinstance(value, bytes) or len(value) != size:
        got = len(value) if isinstance(value, bytes) else type(value).__name__
        raise InvalidField(field, f"must be {size} bytes, got {got}")


def _count(field: str, value: object, low: int = 0) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise InvalidField(field, f"must be an integer >= {low}, got {value!r}")


def _names(field: str, value: object) -> None:
    if not isinstance(value, tuple):
        raise InvalidField(field, "must be a tuple of site names")
    for v in value:
        _name(field, v)
    if len(set(value)) != len(value):
        raise InvalidField(field, "names a site twice")


@dataclass(frozen=True, slots=True)
class Session:
    """One aggregation: a run's round of one fragment. Every key and mask is bound to it."""

    run_id: str
    round: int
    fragment: int

    def __post_init__(self) -> None:
        _name("session.run_id", self.run_id)
        _count("session.round", self.round)
        _count("session.fragment", self.fragment)

    @property
    def context(self) -> bytes:
        return f"{self.run_id}\x00{self.round}\x00{self.fragment}".encode()

    def expect(self, other: Session) -> None:
        """Refuse a message of another session, naming the field that differs."""
        for name in ("run_id", "round", "fragment"):
            if getattr(self, name) != getattr(other, name):
                raise WrongSession(
                    f"session.{name}",
                    f"{getattr(other, name)!r}, this aggregation is {getattr(self, name)!r}",
                )


@dataclass(frozen=True, slots=True)
class KeyAdvert:
    """A site's two X25519 public keys for this session: masks, and the encryption of shares."""

    session: Session
    site: str
    mask_key: bytes
    share_key: bytes

    def __post_init__(self) -> None:
        _name("site", self.site)
        _raw("mask_key", self.mask_key, KEY_BYTES)
        _raw("share_key", self.share_key, KEY_BYTES)


@dataclass(frozen=True, slots=True)
class Roster:
    """What the coordinator publishes after the adverts: who takes part (sorted by name), their
    keys, each one's weight (normalised tokens from the ledger, applied by the site before
    quantising), the public seed of the neighbour graph and the parameters everyone must share."""

    session: Session
    adverts: tuple[KeyAdvert, ...]
    weights: tuple[float, ...]
    seed: bytes
    ring_bits: int
    degree: int
    threshold: int
    numel: int
    block: int
    self_masks: bool

    def __post_init__(self) -> None:
        sites = tuple(a.site for a in self.adverts)
        _names("adverts", sites)
        if list(sites) != sorted(sites) or len(sites) < 2:
            raise InvalidField("adverts", "at least 2 sites, sorted by name")
        if len(self.weights) != len(sites) or not all(w > 0 for w in self.weights):
            raise InvalidField("weights", "one positive weight per site")
        if abs(sum(self.weights) - 1.0) > 1e-6:
            raise InvalidField("weights", f"must sum to 1, got {sum(self.weights)}")
        _raw("seed", self.seed, KEY_BYTES)
        if self.ring_bits not in WIDTHS:
            raise InvalidField("ring_bits", f"must be one of {WIDTHS}, got {self.ring_bits}")
        if not isinstance(self.degree, int) or not 1 <= self.degree <= len(sites) - 1:
            raise InvalidField("degree", f"must be in [1, {len(sites) - 1}], got {self.degree}")
        if not isinstance(self.threshold, int) or not 1 <= self.threshold <= self.degree:
            raise InvalidField("threshold", f"must be in [1, degree={self.degree}], got {self.threshold}")
        _count("numel", self.numel, 1)
        _count("block", self.block, 1)
        for a in self.adverts:
            self.session.expect(a.session)

    @property
    def sites(self) -> tuple[str, ...]:
        return tuple(a.site for a in self.adverts)

    def advert(self, site: str) -> KeyAdvert:
        for a in self.adverts:
            if a.site == site:
                return a
        raise InvalidField("site", f"{site!r} is not in the roster")

    def weight(self, site: str) -> float:
        return self.weights[self.sites.index(self.advert(site).site)]

    def point(self, site: str) -> int:
        """The site's Shamir x-coordinate: its 1-based place in the roster."""
        return self.sites.index(self.advert(site).site) + 1


@dataclass(frozen=True, slots=True)
class EncryptedShare:
    """``sender``'s key shares for ``receiver``, AEAD under their pairwise share key; the session,
    sender and receiver are the associated data, so a share moved to another session or pair
    fails its tag."""

    session: Session
    sender: str
    receiver: str
    nonce: bytes
    ciphertext: bytes

    def __post_init__(self) -> None:
        _name("sender", self.sender)
        _name("receiver", self.receiver)
        if self.sender == self.receiver:
            raise InvalidField("receiver", "a site does not share with itself")
        _raw("nonce", self.nonce, NONCE_BYTES)
        if not isinstance(self.ciphertext, bytes) or len(self.ciphertext) not in (
            TAG_BYTES + 2 + SHARE_BYTES,
            TAG_BYTES + 2 + 2 * SHARE_BYTES,
        ):
            raise InvalidField("ciphertext", "is not the size of one or two sealed shares")


@dataclass(frozen=True, slots=True)
class ShareBundle:
    """All of one site's encrypted shares, one per neighbour."""

    session: Session
    sender: str
    shares: tuple[EncryptedShare, ...]

    def __post_init__(self) -> None:
        _name("sender", self.sender)
        _names("shares.receiver", tuple(s.receiver for s in self.shares))
        for s in self.shares:
            if s.sender != self.sender:
                raise InvalidField("shares.sender", f"{s.sender!r} in a bundle of {self.sender!r}")
            self.session.expect(s.session)


@dataclass(frozen=True, slots=True)
class ShareInbox:
    """The shares addressed to one site, and the cohort: the sites whose bundles arrived. A site
    masks only with neighbours in the cohort (the others could not be recovered if lost)."""

    session: Session
    receiver: str
    shares: tuple[EncryptedShare, ...]
    cohort: tuple[str, ...]

    def __post_init__(self) -> None:
        _name("receiver", self.receiver)
        _names("cohort", self.cohort)


def _exponents(field: str, value: object) -> None:
    if not isinstance(value, np.ndarray) or value.dtype != np.int16 or value.ndim != 1:
        raise InvalidField(field, "must be a 1-D int16 array (one exponent per block)")


@dataclass(frozen=True, slots=True)
class ScaleProposal:
    """A site's per-block exponents (:mod:`.shared_scale`) for its weighted Δ."""

    session: Session
    site: str
    exponents: np.ndarray

    def __post_init__(self) -> None:
        _name("site", self.site)
        _exponents("exponents", self.exponents)


@dataclass(frozen=True, slots=True)
class ScalePlan:
    """The agreed exponent of every block: the largest proposal."""

    session: Session
    exponents: np.ndarray

    def __post_init__(self) -> None:
        _exponents("exponents", self.exponents)


@dataclass(frozen=True, slots=True)
class MaskedChunk:
    """Masked codes of elements [start, start + numel) of one site, at ``ring_bits`` each. A
    site may push its vector in any chunks, from any of its ranks; together they cover it once."""

    session: Session
    site: str
    start: int
    numel: int
    ring_bits: int
    payload: bytes

    def __post_init__(self) -> None:
        _name("site", self.site)
        _count("start", self.start)
        _count("numel", self.numel, 1)
        if self.ring_bits not in WIDTHS:
            raise InvalidField("ring_bits", f"must be one of {WIDTHS}, got {self.ring_bits}")
        _raw("payload", self.payload, packed_size(self.numel, self.ring_bits))


@dataclass(frozen=True, slots=True)
class UnmaskRequest:
    """The push phase's outcome, fixed before any share is revealed: survivors (whole pushes)
    and dropped sites (in the cohort, no whole push)."""

    session: Session
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]

    def __post_init__(self) -> None:
        _names("survivors", self.survivors)
        _names("dropped", self.dropped)
        if set(self.survivors) & set(self.dropped):
            raise InvalidField("dropped", "a site cannot both survive and be dropped")


ShareKind = Literal["mask_key", "self_mask"]


@dataclass(frozen=True, slots=True)
class RevealedShare:
    """One share a survivor holds: of a dropped site's mask key, or of a survivor's self-mask."""

    owner: str
    kind: ShareKind
    y: bytes

    def __post_init__(self) -> None:
        _name("owner", self.owner)
        if self.kind not in ("mask_key", "self_mask"):
            raise InvalidField("kind", f"must be 'mask_key' or 'self_mask', got {self.kind!r}")
        _raw("y", self.y, SHARE_BYTES)


@dataclass(frozen=True, slots=True)
class Reveal:
    """A survivor's answer to the unmask request."""

    session: Session
    site: str
    shares: tuple[RevealedShare, ...]

    def __post_init__(self) -> None:
        _name("site", self.site)
        keys = [(s.owner, s.kind) for s in self.shares]
        if len(set(keys)) != len(keys):
            raise InvalidField("shares", "reveals one share twice")
