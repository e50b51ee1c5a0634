"""Shamir secret sharing of 32-byte keys over the prime field GF(2^521 - 1): arithmetic on Python
ints (no cipher is written here). A secret splits into one share per holder; any ``threshold``
of them give it back, fewer give no information about it."""

from __future__ import annotations

import secrets

from geodiloco.security.secagg.secagg_errors import InvalidField, RecoveryFailed

PRIME = (1 << 521) - 1  # a Mersenne prime: every 256-bit secret is a field element
SECRET_BYTES = 32
SHARE_BYTES = 66  # (521 + 7) // 8


def split(secret: bytes, holders: list[int], threshold: int) -> dict[int, bytes]:
    """One share per holder x (1 <= x < 2^16, distinct), ``threshold`` of which recover ``secret``."""
    if len(secret) != SECRET_BYTES:
        raise InvalidField("secret", f"{len(secret)} bytes, expected {SECRET_BYTES}")
    if len(set(holders)) != len(holders) or any(not 1 <= x < 1 << 16 for x in holders):
        raise InvalidField("holders", "share points must be distinct and in [1, 65535]")
    if not 1 <= threshold <= len(holders):
        raise InvalidField("threshold", f"must be in [1, {len(holders)}] holders, got {threshold}")
    coeffs = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    shares = {}
    for x in holders:
        y = 0
        for c in reversed(coeffs):  # Horner
            y = (y * x + c) % PRIME
        shares[x] = y.to_bytes(SHARE_BYTES, "big")
    return shares


def combine(shares: dict[int, bytes], threshold: int) -> bytes:
    """The secret from ``threshold`` or more shares (Lagrange interpolation at 0)."""
    if len(shares) < threshold:
        raise RecoveryFailed("shares", f"{len(shares)} share(s), the threshold is {threshold}")
    points = []
    for x, raw in sorted(shares.items())[:threshold]:
        y = int.from_bytes(raw, "big")
        if len(raw) != SHARE_BYTES or y >= PRIME or not 1 <= x < 1 << 16:
            raise InvalidField("shares", f"share at x={x} is not a field element of {SHARE_BYTES} bytes")
        points.append((x, y))
    total = 0
    for i, (xi, yi) in enumerate(points):
        num = den = 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                num = num * xj % PRIME
                den = den * (xj - xi) % PRIME
        total = (total + yi * num * pow(den, -1, PRIME)) % PRIME
    if total >= 1 << (8 * SECRET_BYTES):
        raise RecoveryFailed("shares", "the shares do not interpolate to a 32-byte secret (a bad share)")
    return total.to_bytes(SECRET_BYTES, "big")
