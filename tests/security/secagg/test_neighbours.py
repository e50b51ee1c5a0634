"""The SecAgg+ graph: symmetric, of the asked degree, the same for everyone with the seed."""

from __future__ import annotations

import pytest

from geodiloco.security.secagg.neighbours import default_degree, default_threshold, graph
from geodiloco.security.secagg.secagg_errors import InvalidField


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16, 64])
def test_graph_is_symmetric_with_the_default_degree(n: int) -> None:
    sites = tuple(f"dc-{i}" for i in range(n))
    degree = default_degree(n)
    g = graph(sites, b"s" * 32, degree)
    for s, ns in g.items():
        assert s not in ns and len(ns) == degree
        assert all(s in g[o] for o in ns)
    assert graph(sites, b"s" * 32, degree) == g
    if degree < n - 1:
        assert graph(sites, b"t" * 32, degree) != g  # the seed places the sites


def test_degree_is_logarithmic_and_the_threshold_a_majority() -> None:
    assert [default_degree(n) for n in (2, 4, 8, 16, 64, 1024)] == [1, 3, 6, 8, 12, 20]
    assert [default_threshold(d) for d in (1, 3, 6, 8)] == [1, 2, 4, 5]
    with pytest.raises(InvalidField, match="degree"):
        graph(("a", "b", "c"), b"s" * 32, 3)
    with pytest.raises(InvalidField, match="sites"):
        default_degree(1)
