from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.integration


def test_streaming_smoke(run_benchmark: Callable[..., Any]) -> None:
    rows = run_benchmark("streaming.py", timeout_s=300)
    assert [(r["mode"], r["fragments"], r["overlap_steps"]) for r in rows] == [
        ("blocking", 1, 0),
        ("streaming", 2, 1),
    ]
    for row in rows:
        assert (
            row["hashes_agree"] and math.isfinite(row["final_eval_loss"]) and 0 < row["final_eval_loss"] < 6
        )
        assert row["loss_ratio_to_blocking"] is not None and 0.5 < row["loss_ratio_to_blocking"] < 2
        (run,) = row["runs"]
        assert run["tokens"] > 0 and run["short_rounds"] == 0 and run["uplink_bytes"] > 0
    assert rows[0]["loss_ratio_to_blocking"] == 1.0
