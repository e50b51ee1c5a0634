"""AEAD sealing of payloads: AES-256-GCM with random 96-bit nonces.

Why random nonces: a site can crash and push the same round again with different content, so a
nonce derived from (round, seq) would repeat under one key, which breaks GCM. A fresh
``os.urandom(12)`` per chunk travels in the chunk; each key (one per run, site and direction)
seals a few chunks per round, far below the 2^32 messages NIST allows per key with random
nonces. The chunk header is the associated data, so the tag fails for a chunk moved to another
round, fragment, site or position, or altered in any byte.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from geodiloco.security.joinproof import proves
from geodiloco.security.secrets import hkdf, site_secret

NONCE_BYTES = 12
TAG_BYTES = 16
Buffer = bytes | bytearray | memoryview  # what a nonce or a sealed payload may be handed in
DIRECTIONS = ("up", "down")
FILE_MAGIC = b"GDLSEAL1"


class SealError(ValueError):
    """A sealed payload that does not open: wrong key, altered bytes or moved header."""


@dataclass(frozen=True, slots=True)
class ChunkHeaderFields:
    """Everything that places a chunk; all of it is authenticated with the payload."""

    direction: str
    run_id: str
    round: int
    fragment: int
    site: str
    seq: int
    start: int
    numel: int
    codec: str
    kind: str  # delta, update, full_state
    key_id: int
    rows: int = 0
    stride: int = 0

    def aad(self, extra: bytes = b"") -> bytes:
        """A fixed, length-prefixed encoding: never ambiguous, independent of protobuf."""
        text = b"".join(
            struct.pack(">H", len(b)) + b
            for b in (s.encode() for s in (self.direction, self.run_id, self.site, self.codec, self.kind))
        )
        numbers = struct.pack(
            ">QIQQQIIQ",
            self.round,
            self.fragment,
            self.seq,
            self.start,
            self.numel,
            self.key_id,
            self.rows,
            self.stride,
        )
        return b"geodiloco-chunk-v2\0" + text + numbers + struct.pack(">H", len(extra)) + extra


class Sealer:
    """One AEAD key; seals with a fresh random nonce every time."""

    def __init__(self, key: bytes, key_id: int) -> None:
        self._aead = AESGCM(key)
        self.key_id = key_id

    def __repr__(self) -> str:  # the key never appears in logs or tracebacks
        return f"Sealer(key_id={self.key_id:08x})"

    def seal(self, payload: bytes | memoryview, aad: bytes) -> tuple[bytes, bytes]:
        nonce = os.urandom(NONCE_BYTES)
        return nonce, self._aead.encrypt(nonce, payload, aad)

    def open(
        self, nonce: bytes | bytearray | memoryview, sealed: bytes | bytearray | memoryview, aad: bytes
    ) -> bytes:
        _check_sizes(nonce, sealed)
        try:
            return self._aead.decrypt(nonce, sealed, aad)
        except InvalidTag:
            raise SealError(_MISMATCH) from None

    def open_into(self, nonce: Buffer, sealed: Buffer, aad: bytes, out: memoryview) -> None:
        """:meth:`open` written into ``out`` (exactly the payload's size), not a new buffer: a
        restart opens hundreds of megabytes of state straight into the memory it keeps."""
        _check_sizes(nonce, sealed)
        if len(out) != len(sealed) - TAG_BYTES:
            raise SealError(f"{len(out)} bytes to open {len(sealed) - TAG_BYTES} into")
        try:
            if hasattr(self._aead, "decrypt_into"):  # cryptography >= 45
                self._aead.decrypt_into(nonce, sealed, aad, out)
            else:
                out[:] = self._aead.decrypt(nonce, sealed, aad)
        except InvalidTag:
            raise SealError(_MISMATCH) from None


_MISMATCH = (
    "authentication tag mismatch: the payload was altered, moved to another "
    "round/fragment/site/position, or sealed with another key"
)


def _check_sizes(nonce: Buffer, sealed: Buffer) -> None:
    if len(nonce) != NONCE_BYTES:
        raise SealError(f"nonce must be {NONCE_BYTES} bytes, got {len(nonce)}")
    if len(sealed) < TAG_BYTES:
        raise SealError(f"sealed payload of {len(sealed)} bytes is shorter than its tag")


def key_id(site_secret: bytes, run_id: str) -> int:
    """A public 32-bit fingerprint of a site's keys for a run, so a wrong secret is named as such."""
    return int.from_bytes(hkdf(site_secret, b"key-id\0" + run_id.encode(), 4), "big") or 1


@dataclass(frozen=True, slots=True)
class SiteKeys:
    """The two chunk keys of one site in one run."""

    up: Sealer  # site -> coordinator
    down: Sealer  # coordinator -> site

    @property
    def key_id(self) -> int:
        return self.up.key_id

    @classmethod
    def derive(cls, site_secret: bytes, run_id: str) -> SiteKeys:
        kid = key_id(site_secret, run_id)
        up, down = (hkdf(site_secret, f"chunk\0{run_id}\0{d}".encode()) for d in DIRECTIONS)
        return cls(Sealer(up, kid), Sealer(down, kid))


def at_rest_sealer(run_secret: bytes, run_id: str, label: str) -> Sealer:
    """The key for the coordinator's own files (state, checkpoints) of one run."""
    key = hkdf(run_secret, f"at-rest\0{run_id}\0{label}".encode())
    return Sealer(key, key_id(run_secret, run_id))


def write_sealed(path: Path, data: bytes, sealer: Sealer, label: str) -> None:
    """Seal ``data`` into ``path`` atomically; ``label`` (e.g. the file's role) is authenticated."""
    nonce, sealed = sealer.seal(data, FILE_MAGIC + label.encode())
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(FILE_MAGIC + nonce + sealed)
    tmp.replace(path)


def read_sealed(path: Path, sealer: Sealer, label: str) -> bytes:
    blob = path.read_bytes()
    if not blob.startswith(FILE_MAGIC):
        raise SealError(f"{path} is not a sealed geodiloco file")
    body = blob[len(FILE_MAGIC) :]
    return sealer.open(body[:NONCE_BYTES], body[NONCE_BYTES:], FILE_MAGIC + label.encode())


class Keyring:
    """The coordinator's keys: every site's chunk keys, derived on demand from the run secret."""

    def __init__(self, run_secret: bytes, run_id: str) -> None:
        self._run_secret = run_secret
        self.run_id = run_id
        self._sites: dict[str, SiteKeys] = {}

    def __repr__(self) -> str:  # the secret never appears in logs or tracebacks
        return f"Keyring(run_id={self.run_id!r})"

    def site(self, name: str) -> SiteKeys:
        keys = self._sites.get(name)
        if keys is None:
            keys = self._sites[name] = SiteKeys.derive(site_secret(self._run_secret, name), self.run_id)
        return keys

    def proves_key(self, name: str, proof: bytes, run_id: str, world_size: int) -> bool:
        """Whether a Join's ``proof`` was made with ``name``'s site secret (:mod:`.joinproof`)."""
        return proves(site_secret(self._run_secret, name), proof, run_id, name, world_size)

    def at_rest(self, label: str) -> Sealer:
        return at_rest_sealer(self._run_secret, self.run_id, label)
