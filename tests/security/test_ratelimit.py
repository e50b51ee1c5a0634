"""The per-peer join limiter: bursts up to the limit, refills over time, bounded memory."""

from __future__ import annotations

import pytest

from geodiloco.security.ratelimit import RateLimiter


def test_bursts_up_to_the_limit_then_refills_at_the_rate() -> None:
    limiter = RateLimiter(per_minute=6)
    assert [limiter.allow("a", now=0.0) for _ in range(7)] == [True] * 6 + [False]
    assert limiter.allow("b", now=0.0)  # another peer has its own bucket
    assert not limiter.allow("a", now=5.0)
    assert limiter.allow("a", now=10.5)  # one token every 10 s
    assert not limiter.allow("a", now=10.6)


def test_memory_is_bounded_by_max_peers() -> None:
    limiter = RateLimiter(per_minute=1, max_peers=3)
    for i in range(100):
        limiter.allow(f"peer-{i}", now=0.0)
    assert len(limiter._buckets) == 3
    with pytest.raises(ValueError, match="per_minute"):
        RateLimiter(per_minute=0)
