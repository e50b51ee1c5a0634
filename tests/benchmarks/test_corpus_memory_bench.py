from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.integration


def test_corpus_memory_smoke(run_benchmark: Callable[..., Any]) -> None:
    r = run_benchmark("corpus_memory.py", timeout_s=540)
    assert r["settings"] == {"rounds": 1, "steps_per_round": 2, "sites": 1, "ranks": 1}
    assert [run["corpus_bytes"] for run in r["runs"]] == [1_000_000, 40_000_000]
    for run in r["runs"]:
        assert 50 < run["coordinator_peak_rss_mb"] < 4000 and 50 < run["rank_peak_rss_mb"] < 4000, run
        assert run["wall_s"] > 0 and run["files"] == 1
    # 39 MB more text: neither process holds it (holding it once would add 39 MB)
    assert abs(r["coordinator_growth_mb"]) < 20 and abs(r["rank_growth_mb"]) < 20, r
