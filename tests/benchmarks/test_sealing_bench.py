from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.integration  # the script runs as its own process


def test_sealing_smoke(run_benchmark: Callable[..., Any]) -> None:
    r = run_benchmark("sealing.py")
    assert r["numel"] == 2 << 20 and r["chunks"] == 2 and r["repeats"] == 1
    assert r["codec"] == "q8|zstd:3" and r["aead"] == "AES-256-GCM"
    assert 0 < r["payload_bytes"] < 4 * r["numel"]
    assert r["sealing_bytes_added"] > 0  # a nonce and a tag per chunk
    for key in ("encode_s", "encode_sealed_s", "decode_s", "decode_opened_s", "seal_only_s", "open_only_s"):
        assert r[key] > 0, key
    for key in ("encode_overhead", "decode_overhead", "pipeline_overhead", "aead_overhead"):
        assert math.isfinite(r[key]) and r[key] > -1, key
    assert r["target_overhead"] == 0.25
