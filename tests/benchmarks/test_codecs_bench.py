from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.integration  # the script runs as its own process


def test_codecs_smoke(run_benchmark: Callable[..., Any]) -> None:
    entries = run_benchmark("codecs.py", timeout_s=420)
    rows = [e for e in entries if e["name"] != "memcpy_MBps"]
    memcpy = [e for e in entries if e["name"] == "memcpy_MBps"]
    tensors = {r["tensor"] for r in rows}
    assert {"pseudo-gradient", "gaussian"} < tensors and len(tensors) == 3  # and the chunked large one
    assert {m["tensor"] for m in memcpy} == tensors and all(m["memcpy_MBps"] > 0 for m in memcpy)
    assert {r["sealed"] for r in rows} == {"off", "on"}
    for r in rows:
        assert 0 < r["bits_per_param"] <= 40, r
        assert math.isfinite(r["rel_l2_error"]) and 0 <= r["rel_l2_error"] < 1.5, r
        assert -1 <= r["cosine"] <= 1 + 1e-9, r
        assert r["encode_MBps"] > 0 and r["decode_MBps"] > 0 and r["entropy_gain"] > 0, r
    exact = [r for r in rows if r["name"] == "fp32"]
    assert len(exact) == 4 and all(r["rel_l2_error"] == 0 and r["bits_per_param"] > 32 for r in exact)
    q8 = next(r for r in rows if r["name"] == "q8" and r["tensor"] == "gaussian" and r["sealed"] == "off")
    assert 8 <= q8["bits_per_param"] < 9 and q8["rel_l2_error"] < 0.02
