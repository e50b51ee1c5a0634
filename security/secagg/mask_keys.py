"""Keys and mask streams: X25519 agreement, HKDF-SHA256, and ChaCha20 keystreams indexed by
absolute element position (``cryptography``'s primitives; nothing here is a cipher).

Element e of a stream is the little-endian uint16 at keystream bytes [2e, 2e+2): a range
[start, start+n) is cut from the stream by the block counter, so any shard or chunk of the
vector draws the same masks as a whole-vector pass, and sums cancel whatever the layout.
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from geodiloco.security.secagg.secagg_errors import InvalidField

KEY_BYTES = 32
PIECE = 1 << 16  # elements per pass: a keystream piece (128 KiB) stays in L2 while it is added
_BLOCK = 64  # ChaCha20 block bytes
_MAX_ELEMENTS = (1 << 32) * _BLOCK // 2  # the 32-bit block counter's reach


def private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes_raw()


def public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes_raw()


def load_private(raw: bytes) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(raw)


def _hkdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(secret)


def _label(*parts: bytes) -> bytes:
    return b"".join(len(p).to_bytes(2, "big") + p for p in parts)


def agree(own: X25519PrivateKey, peer_public: bytes, field: str) -> bytes:
    """The X25519 shared secret with ``peer_public``; a malformed or low-order key is refused."""
    if len(peer_public) != KEY_BYTES:
        raise InvalidField(field, f"{len(peer_public)} bytes, an X25519 public key has {KEY_BYTES}")
    try:
        return own.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as e:  # the all-zero shared secret of a low-order point
        raise InvalidField(field, f"unusable X25519 public key ({e})") from None


def pair_seed(shared: bytes, context: bytes, a: str, b: str) -> bytes:
    """The mask seed of the pair {a, b} in one aggregation (``context``: run, round, fragment)."""
    lo, hi = sorted((a, b))
    return _hkdf(shared, _label(b"geodiloco secagg mask", context, lo.encode(), hi.encode()))


def share_key(shared: bytes, context: bytes, sender: str, receiver: str) -> bytes:
    """The AEAD key of the shares ``sender`` encrypts to ``receiver`` (one direction)."""
    return _hkdf(shared, _label(b"geodiloco secagg shares", context, sender.encode(), receiver.encode()))


def _keystream(seed: bytes, start: int) -> object:
    """A ChaCha20 encryptor positioned at element ``start``."""
    offset = 2 * start
    counter = (offset // _BLOCK).to_bytes(4, "little")
    enc = Cipher(algorithms.ChaCha20(seed, counter + bytes(12)), mode=None).encryptor()
    if offset % _BLOCK:
        enc.update(bytes(offset % _BLOCK))
    return enc


def masks(
    numel: int,
    start: int,
    terms: list[tuple[bytes, int]],
    out: np.ndarray | None = None,
    accumulate: bool = False,
) -> np.ndarray:
    """Σ sign · stream(seed)[start : start + numel] mod 2^16 as uint16, for (seed, ±1) ``terms``,
    written to ``out`` (added to it with ``accumulate``) or to a new array. Pass a reused ``out``
    where speed matters: a fresh multi-MB array costs about as much in page faults as a stream."""
    if start < 0 or start + numel > _MAX_ELEMENTS:
        raise InvalidField("start", f"elements [{start}, {start + numel}) are outside the mask streams")
    fresh = not accumulate
    acc = np.empty(numel, dtype=np.uint16) if out is None else out
    if acc.dtype != np.uint16 or acc.size != numel:
        raise InvalidField("out", "the accumulator must be uint16 of numel elements")
    if fresh and not terms:
        acc[:] = 0
        return acc
    # positive terms first: the first stream of a fresh array lands in it with no add
    ordered = sorted(terms, key=lambda t: -t[1])
    streams = [_keystream(seed, start) for seed, _ in ordered]
    zeros = memoryview(bytes(2 * min(PIECE, numel)))  # sliced without a copy
    tmp = np.empty(min(PIECE, numel), dtype=np.uint16)
    for lo in range(0, numel, PIECE):
        n = min(PIECE, numel - lo)
        part = acc[lo : lo + n]
        for i, (enc, (_, sign)) in enumerate(zip(streams, ordered, strict=True)):
            if fresh and i == 0:
                enc.update_into(zeros[: 2 * n], part.view(np.uint8))  # type: ignore[attr-defined]
                if sign < 0:
                    np.negative(part, out=part)
                continue
            enc.update_into(zeros[: 2 * n], tmp[:n].view(np.uint8))  # type: ignore[attr-defined]
            (np.add if sign > 0 else np.subtract)(part, tmp[:n], out=part)
    return acc
