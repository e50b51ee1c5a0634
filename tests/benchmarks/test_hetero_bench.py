from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEYS = {
    "mode",
    "goodput",
    "fast_idle_share",
    "late_merged",
    "late_dropped",
    "wall_s",
    "final_eval_loss",
    "eval_loss_at_equal_wall",
    "hashes_agree",
    "ledger_audit_clean",
}


def test_hetero_smoke(run_benchmark: Callable[..., Any]) -> None:
    r = run_benchmark("hetero.py", timeout_s=900)
    assert r["slowdown"] == 2.0 and r["round_seconds"] > 0 and r["initial_eval_loss"] > 0
    assert r["overlap_steps"] >= 1
    assert [row["mode"] for row in r["rows"]] == ["a", "b", "c"]
    for row in r["rows"]:
        assert set(row) == KEYS, f"mode {row['mode']}: {set(row) ^ KEYS}"
        details = r["details"][row["mode"]]
        assert details["reached_budget"] and details["tokens_computed"] >= details["tokens_committed"] > 0
        assert details["rounds_lost"] == 0
        assert 0 < row["goodput"] <= 1 and 0 <= row["fast_idle_share"] < 1
        assert row["hashes_agree"] and row["ledger_audit_clean"]
        # wall_s counts from the first commit: 0 where a mode's first round already reached the
        # budget, which a smoke run's few rounds allow when the window came out long on a loaded CI
        assert row["wall_s"] >= 0 and row["final_eval_loss"] > 0 and row["eval_loss_at_equal_wall"] > 0
        assert row["late_merged"] >= 0 and row["late_dropped"] >= 0
    assert r["rows"][0]["late_merged"] == 0  # step rounds drop late pushes
    assert r["details"]["a"]["tokens_committed"] == r["token_budget"]
