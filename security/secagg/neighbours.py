"""The sparse masking graph of SecAgg+ (Bell et al. 2020): each site masks with ``degree``
neighbours, not with every other site, so its masking cost grows as O(log n), not O(n).

The graph is a Harary graph over a permutation of the sites drawn from a public seed: sites on
a cycle, each joined to the degree/2 nearest on either side. The seed is a hash of the session
and every advertised key (:func:`graph_seed`), so everyone computes the same graph and the
coordinator cannot choose who neighbours whom.
"""

from __future__ import annotations

import hashlib
import math

from geodiloco.security.secagg.secagg_errors import InvalidField


def graph_seed(context: bytes, keys: list[tuple[str, bytes, bytes]]) -> bytes:
    """SHA-256 of the session and each (site, mask key, share key), in the given (roster) order."""
    h = hashlib.sha256(b"geodiloco secagg graph\x00" + context)
    for site, mask_key, share_key in keys:
        h.update(len(site).to_bytes(2, "big") + site.encode() + mask_key + share_key)
    return h.digest()


def default_degree(sites: int) -> int:
    """2·⌈log2 n⌉ neighbours, capped at n - 1: every other site up to 7 sites, 8 of 15 at 16."""
    if sites < 2:
        raise InvalidField("sites", f"secure aggregation needs at least 2 sites, got {sites}")
    return min(sites - 1, 2 * math.ceil(math.log2(sites)))


def default_threshold(degree: int) -> int:
    """A majority of a site's neighbours recovers its mask key; fewer learn nothing of it."""
    return degree // 2 + 1


def graph(sites: tuple[str, ...], seed: bytes, degree: int) -> dict[str, tuple[str, ...]]:
    """Each site's neighbours, sorted by name; symmetric (j in N(i) iff i in N(j))."""
    n = len(sites)
    if n < 2 or len(set(sites)) != n:
        raise InvalidField("sites", "need at least 2 distinct sites")
    if not 1 <= degree <= n - 1:
        raise InvalidField("degree", f"must be in [1, {n - 1}] for {n} sites, got {degree}")
    order = sorted(sites, key=lambda s: hashlib.sha256(seed + s.encode()).digest())
    if degree == n - 1:
        return {s: tuple(sorted(set(sites) - {s})) for s in sites}
    reach = (degree + 1) // 2  # an odd degree below n - 1 rounds up to even: the graph stays symmetric
    out: dict[str, set[str]] = {s: set() for s in sites}
    for p, s in enumerate(order):
        for d in range(1, reach + 1):
            other = order[(p + d) % n]
            out[s].add(other)
            out[other].add(s)
    return {s: tuple(sorted(v)) for s, v in out.items()}
