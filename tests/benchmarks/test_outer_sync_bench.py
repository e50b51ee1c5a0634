from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.integration


def test_outer_sync_smoke(run_benchmark: Callable[..., Any]) -> None:
    r = run_benchmark("outer_sync.py", timeout_s=420)
    assert r["settings"]["smoke"] and r["settings"]["rounds"] == 2
    assert [x["layout"] for x in r["results"]] == ["ddp", "fsdp"]
    for x in r["results"]:
        assert x["rounds_measured"] == 2
        assert 0 < x["sync_s_min"] <= x["sync_s_median"] <= x["sync_s_max"]
        assert set(x["phase_s_median"]) == {"encode", "exchange", "apply", "hash"}
        assert x["params"] > 0 and len(x["local_elements_per_rank"]) == 2
        assert sum(x["pushed_elements_per_rank"]) == x["params"]  # each element pushed by one rank
        assert all(b > 0 for b in x["sent_bytes_per_round_per_rank"] + x["received_bytes_per_round_per_rank"])
