from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.integration

ROW = {"rule", "attack", "final_eval_loss", "honest_eval_loss"}


def test_robust_smoke(run_benchmark: Callable[..., Any]) -> None:
    r = run_benchmark("robust.py", timeout_s=300)
    assert r["sites"] == 4 and r["default_rule"] == "filtered_mean" and r["runs_clean"]
    assert [(row["rule"], row["attack"]) for row in r["poison"]] == [
        ("filtered_mean", "sign_flip"),
        ("mean", "sign_flip"),
    ]
    for row in r["poison"]:
        assert set(row) == ROW
        assert 0 < row["final_eval_loss"] < 10 and 0 < row["honest_eval_loss"] < 10
    assert len(r["poison_vs_honest"]) == len(r["poison"])
    assert set(r["honest_all"]) == {"filtered_mean", "mean"}
    assert abs(r["honest_default_vs_mean"]) < 0.5
