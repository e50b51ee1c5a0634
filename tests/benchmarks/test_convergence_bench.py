from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.integration


def test_convergence_smoke(run_benchmark: Callable[..., Any]) -> None:
    (entry,) = run_benchmark("convergence.py", timeout_s=420)
    assert entry["name"] == "int8" and entry["pipeline"] == "q8|zstd:1"
    assert 8 <= entry["bits_per_param"] < 9
    assert math.isfinite(entry["final_eval_loss"]) and 0 < entry["final_eval_loss"] < 6  # bytes: ln 256 = 5.5
    assert entry["wan_bytes"] > 0 and entry["wire_bits_up"] > 0 and entry["wire_bits_down"] > 0
    (run,) = entry["runs"]
    assert run["hashes_agree"] and run["short_rounds"] == 0
    assert [p["tokens"] for p in run["curve"]] == sorted({p["tokens"] for p in run["curve"]})
    assert len(run["curve"]) == 2 and run["tokens"] > 0
