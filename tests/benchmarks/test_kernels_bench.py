from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.integration  # the script runs as its own process


def test_kernels_smoke(run_benchmark: Callable[..., Any]) -> None:
    rows = run_benchmark("kernels.py")
    assert [r["pass"] for r in rows] == [
        "encode",
        "unpack",
        "sumsq_q8",
        "fold_q8",
        "nesterov_send",
        "apply_q8",
        "apply_q8 (residual)",
        "checksum_range",
    ]
    for r in rows:
        assert r["elements"] == 4096
        assert math.isfinite(r["ms"]) and r["ms"] > 0, r
        assert r["ns_per_element"] == pytest.approx(r["ms"] * 1e6 / 4096), r


def test_kernels_sparse_smoke(run_benchmark: Callable[..., Any]) -> None:
    rows = run_benchmark("kernels.py", "--sparse", "topk:0.065:4096|sign:256")
    assert [r["pass"] for r in rows] == [
        "memcpy",
        "topk",
        "topk (portable)",
        "elias_fano_encode",
        "sign_encode",
        "encode",
        "encode + residual",
        "elias_fano_decode",
        "sign_decode (scatter)",
        "decode",
        "apply",
    ]
    for r in rows:
        assert r["elements"] == 4096
        assert math.isfinite(r["ms"]) and r["ms"] > 0, r
