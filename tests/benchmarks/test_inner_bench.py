from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.integration

KEYS = {
    "params",
    "device",
    "layout",
    "tokens_per_s_plain",
    "tokens_per_s_geodiloco",
    "ratio",
    "outer_sync_share",
    "peak_memory_bytes",
    "activation_checkpointing",
    "compile",
}


def test_inner_smoke(run_benchmark: Callable[..., Any]) -> None:
    r = run_benchmark("inner.py", "--activation-checkpointing", "selective", timeout_s=420)
    assert r["settings"]["smoke"] and r["settings"]["steps"] == 5
    [row] = r["rows"]
    assert set(row) == KEYS
    assert row["params"] > 0 and row["device"] == "cpu" and row["layout"].startswith("ddp")
    assert (row["activation_checkpointing"], row["compile"]) == ("selective", False)
    assert row["tokens_per_s_plain"] > 0 and row["tokens_per_s_geodiloco"] > 0
    assert row["ratio"] == pytest.approx(row["tokens_per_s_geodiloco"] / row["tokens_per_s_plain"])
    assert 0 < row["outer_sync_share"] < 1  # the measured round's outer sync took some time
    assert row["peak_memory_bytes"] > 10 * 2**20  # a process's RSS, torch loaded
    [detail] = r["details"]
    # both loops trained the same steps: a warm-up round and one measured round of 5
    for role in ("plain", "geodiloco"):
        assert sum(s["tokens"] for s in detail["segments"][role]) == 2 * 5 * 2 * 16
