from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest


def test_sparse_study_smoke(run_benchmark: Callable[..., Any]) -> None:
    dense, sparse = run_benchmark("sparse_study.py", timeout_s=300)
    assert (dense["name"], dense["uplink"], dense["downlink"]) == ("none", "fp32", "exact")
    assert dense["bits_up"] == pytest.approx(32.0, rel=0.01) and dense["bits_down"] is None
    assert sparse["decays"] == {"downlink_decay": 1.0}
    # every byte of a frame: 10% of the elements' indices and 2-bit values, scales, the header
    assert 0.5 < sparse["bits_up"] < 1.5 and sparse["bits_up"] < sparse["bits_down"] < 2.5
    for entry in (dense, sparse):
        (run,) = entry["runs"]
        assert len(run["curve"]) == 2 and all(math.isfinite(v) and 0 < v < 6 for v in run["curve"])
        assert entry["final_eval_loss"] == run["curve"][-1]
