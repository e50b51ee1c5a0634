"""A token bucket per peer, so a flood of Joins costs the coordinator a dictionary lookup.

Memory is bounded: at most ``max_peers`` buckets are kept, the least recently used dropped.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    """``per_minute`` events per key, with bursts of up to ``per_minute``."""

    def __init__(self, per_minute: int, max_peers: int = 4096) -> None:
        if per_minute <= 0:
            raise ValueError(f"per_minute: must be > 0, got {per_minute}")
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.max_peers = max_peers
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def allow(self, key: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        bucket = self._buckets.pop(key, None) or _Bucket(self.capacity, now)
        bucket.tokens = min(self.capacity, bucket.tokens + (now - bucket.updated) * self.rate)
        bucket.updated = now
        self._buckets[key] = bucket
        if len(self._buckets) > self.max_peers:
            self._buckets.popitem(last=False)
        if bucket.tokens < 1.0:
            return False
        bucket.tokens -= 1.0
        return True
