from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.integration


def test_recovery_smoke(run_benchmark: Callable[..., Any]) -> None:
    r = run_benchmark("recovery.py", timeout_s=540)
    assert r["settings"]["sites"] == 2 and r["settings"]["repeats"] == 1
    assert r["startup_to_round_3_s"] > 0 and r["typical_round_s"] > 0
    (death,) = r["site_death"]
    assert 0 < death["death_to_commit_s"] < 60 and death["restart_to_contribution_s"] > 0
    (coord,) = r["coordinator_death"]
    assert 0 < coord["kill_to_serving_s"] < coord["kill_to_commit_s"]
    (catch_up,) = r["catch_up"]
    assert catch_up["bandwidth_mbps"] == 50.0 and catch_up["state_bytes"] == 4 * r["num_params"]
    assert catch_up["updates_bytes"] > 0 and 0 < catch_up["full_state_bytes"] <= catch_up["state_bytes"]
    assert catch_up["full_state_s"] > 0 and catch_up["updates_s"] > 0 and catch_up["missed_rounds"] >= 1
    assert r["rounds_committed"] > 3
