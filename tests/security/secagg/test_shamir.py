"""Shamir sharing over GF(2^521 - 1): any threshold of shares recovers the key, fewer refuse."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from geodiloco.security.secagg import shamir
from geodiloco.security.secagg.secagg_errors import InvalidField, RecoveryFailed


@settings(max_examples=25, deadline=None)
@given(
    secret=st.binary(min_size=32, max_size=32),
    holders=st.lists(st.integers(1, 65535), min_size=1, max_size=7, unique=True),
    data=st.data(),
)
def test_any_threshold_of_shares_recovers_the_secret(
    secret: bytes, holders: list[int], data: st.DataObject
) -> None:
    t = data.draw(st.integers(1, len(holders)))
    shares = shamir.split(secret, holders, t)
    assert set(shares) == set(holders) and all(len(y) == shamir.SHARE_BYTES for y in shares.values())
    for subset in itertools.islice(itertools.combinations(holders, t), 5):
        assert shamir.combine({x: shares[x] for x in subset}, t) == secret
    if t > 1:
        with pytest.raises(RecoveryFailed, match="threshold is"):
            shamir.combine({x: shares[x] for x in holders[: t - 1]}, t)


def test_fewer_shares_than_the_threshold_fit_any_secret() -> None:
    """t - 1 shares are consistent with every secret: for two secrets, the same t - 1 shares
    come out of some polynomial through each (so they say nothing of which it was)."""
    a, b = bytes(32), b"\xff" * 32
    shares = shamir.split(a, [1, 2, 3], 3)
    # a degree-2 polynomial through (0, b), (1, y1), (2, y2) exists; its value at 3 completes it
    pts = {1: shares[1], 2: shares[2]}
    y = [int.from_bytes(pts[x], "big") for x in (1, 2)]
    s_b = int.from_bytes(b, "big")
    # Lagrange at x = 3 through (0, s_b), (1, y1), (2, y2)
    y3 = (s_b * 1 + y[0] * (-3) + y[1] * 3) % shamir.PRIME
    assert shamir.combine({**pts, 3: y3.to_bytes(shamir.SHARE_BYTES, "big")}, 3) == b


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(InvalidField, match="secret"):
        shamir.split(bytes(31), [1, 2], 2)
    with pytest.raises(InvalidField, match="holders"):
        shamir.split(bytes(32), [1, 1], 2)
    with pytest.raises(InvalidField, match="threshold"):
        shamir.split(bytes(32), [1, 2], 3)
    with pytest.raises(InvalidField, match="shares"):
        shamir.combine({1: bytes(65), 2: bytes(66)}, 2)
