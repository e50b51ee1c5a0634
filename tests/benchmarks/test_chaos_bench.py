from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_chaos_smoke(run_benchmark: Callable[..., Any]) -> None:
    r = run_benchmark("chaos.py", timeout_s=900)
    assert r["rounds"] == 8 and r["rounds_committed"] == 8 and r["rounds_lost"] == 0
    assert r["hash_mismatches"] == 0 and r["ledger_audit"] == "clean"
    assert [f["fired"] for f in r["faults"]] == [True, True]
    assert r["faults"][1]["fault"]["action"] == "raise" and r["faults"][0]["fired_at"] == 2
    assert all(f["longest_stall_s"] > 0 for f in r["faults"]) and r["longest_stall_s"] > 0
    assert r["restarts"]["site-2"] == 1 and r["restarts"]["coordinator"] == 1
    (restart,) = r["coordinator_restarts"]
    assert 0 < restart["restart_to_serving_s"] <= restart["restart_to_next_commit_s"]
    assert r["final_eval_loss"] > 0 and r["fault_free_eval_loss"] > 0 and r["eval_loss_ratio"] > 0
    for key in (
        "settings",
        "num_params",
        "slow_link_mbps",
        "rounds_repeated",
        "typical_round_s",
        "longest_stall_over_round_s",
        "chaos_wall_s",
        "fault_free_wall_s",
    ):
        assert key in r
