"""Test tiers (pytest markers):

- unit (no marker): plain tensors and in-process objects; seconds in all.
- ``integration``: real gRPC servers and clients over loopback, real torch.distributed
  process groups (gloo) in real processes.
- ``slow``: long end-to-end runs (many processes, many rounds, tens of seconds); run in CI too.

Select with ``-m "not slow"`` for a quick loop; CI runs everything.

Files run slow first, then integration, then unit (each file's own order kept). `make test`
hands whole files to two workers in this order (``--dist loadfile --no-loadscope-reorder``):
the long runs start at once and the short files even out the end, where xdist's default order
(most tests first) left the minute-long single-test files for last, on one worker.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def _tier(item: pytest.Item) -> int:
    if item.get_closest_marker("slow"):
        return 0
    return 1 if item.get_closest_marker("integration") else 2


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[Any]:
    """Gloo rank processes spawned once per test worker, reused by the tests that run a
    function on every rank of a small group (geodiloco.testing.rank_pool)."""
    from geodiloco.testing.rank_pool import RankPool

    pool = RankPool(6)
    yield pool
    pool.close()


@pytest.fixture(scope="module", autouse=True)
def _trim_rank_pool(rank_pool: Any) -> Iterator[None]:
    """After each module, the pool keeps at most 4 idle rank processes (the largest groups,
    6 ranks, are the layout tests')."""
    yield
    rank_pool.trim(4)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tier: dict[Path, int] = {}
    first: dict[Path, int] = {}
    for index, item in enumerate(items):
        first.setdefault(item.path, index)
        tier[item.path] = min(tier.get(item.path, 2), _tier(item))
    items.sort(key=lambda item: (tier[item.path], first[item.path]))
