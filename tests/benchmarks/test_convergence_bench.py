from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.integration


def test_convergence_smoke(run_benchmark: Callable[..., Any]) -> None:
    entries = run_benchmark("convergence.py", timeout_s=600)
    assert [(e["start"], e["name"]) for e in entries] == [
        ("scratch", "none"),
        ("scratch", "int8"),
        ("warm", "none"),
    ]
    for entry in entries:
        is_dense = entry["name"] == "none"
        assert entry["pipeline"] == ("fp32" if is_dense else "q8|zstd:1")
        bits = 32 if is_dense else 8
        assert bits <= entry["bits_per_param"] < bits + 1
        assert entry["downlink_bits_per_param"] == entry["bits_per_param"]  # one spec both ways
        assert math.isfinite(entry["final_eval_loss"]) and 0 < entry["final_eval_loss"] < 6  # ln 256 = 5.5
        # the worst seed's loss over the dense run's of the same seed and start (one seed here)
        (run,) = entry["runs"]
        (dense,) = next(e for e in entries if e["name"] == "none" and e["start"] == entry["start"])["runs"]
        assert entry["worst_seed_ratio"] == pytest.approx(run["final_eval_loss"] / dense["final_eval_loss"])
        assert entry["wan_bytes"] > 0 and entry["wire_bits_up"] > 0 and entry["wire_bits_down"] > 0
        assert run["hashes_agree"] and run["short_rounds"] == 0
        assert [p["tokens"] for p in run["curve"]] == sorted({p["tokens"] for p in run["curve"]})
        assert len(run["curve"]) == 2 and run["tokens"] > 0
    # the warm start is a trained model: its runs start lower than those from scratch
    assert entries[2]["runs"][0]["curve"][0]["eval_loss"] < entries[0]["runs"][0]["curve"][0]["eval_loss"]
