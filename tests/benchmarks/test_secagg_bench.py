from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.integration  # the script runs as its own process

KEYS = {
    "sites", "params", "codec", "exact_sum", "expansion", "mask_ms_per_mparam", "unmask_ms_per_mparam",
    "dropout_recovered", "dropout_extra_s", "final_eval_loss_secure", "final_eval_loss_plain", "poison",
}  # fmt: skip


def test_secagg_smoke(run_benchmark: Callable[..., Any]) -> None:
    rows = run_benchmark("secagg.py")
    assert [r["sites"] for r in rows] == [4, 8, 16]
    for r in rows:
        assert set(r) == KEYS
        assert r["params"] == 1 << 16 and r["codec"] == "q8"
        assert r["exact_sum"] is True and r["dropout_recovered"] is True
        assert 1.0 < r["expansion"] < 1.7  # the ring's bits over the int8 codec's 8.25, plus keys and shares
        assert r["mask_ms_per_mparam"] > 0 and r["unmask_ms_per_mparam"] > 0 and r["dropout_extra_s"] >= 0
        assert r["final_eval_loss_secure"] is None and r["final_eval_loss_plain"] is None
    # the 4-site row carries benchmarks/robust.py's poisoning runs (smoke: one attack, two rules)
    poison = rows[0]["poison"]
    assert [(p["rule"], p["attack"]) for p in poison] == [
        ("filtered_mean", "sign_flip"),
        ("mean", "sign_flip"),
    ]
    assert all(p["final_eval_loss"] > 0 and p["honest_eval_loss"] > 0 for p in poison)
    assert rows[1]["poison"] == [] and rows[2]["poison"] == []
    assert rows[0]["expansion"] < rows[2]["expansion"]  # a wider ring for more sites
