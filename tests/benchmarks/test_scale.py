"""Smoke run of benchmarks/scale.py: one small case end to end, its JSON keys and its plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scale.py"
KEYS = {
    "params",
    "sites",
    "overhead_s",
    "floor_s",
    "coordinator_peak_rss_bytes",
    "max_loop_stall_ms",
    "disk_bytes_per_round",
    "restart_to_serving_s",
}


def test_scale_smoke_writes_every_key_and_a_plot(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--json", str(out)], capture_output=True, timeout=600
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 1 and set(rows[0]) >= KEYS
    row = rows[0]
    assert row["params"] == 200_000 and row["sites"] == 2
    assert row["overhead_s"] > 0 and row["floor_s"] > 0 and row["coordinator_peak_rss_bytes"] > 0
    assert len(row["floor_samples_s"]) == 3 and sorted(row["floor_samples_s"])[1] == row["floor_s"]
    assert 0 < row["serving_peak_rss_bytes"] <= row["coordinator_peak_rss_bytes"]
    assert row["disk_bytes_per_round"] <= 2 * row["update_bytes"]  # between snapshots: the update only
    assert row["lease_expiries"] == 0
    assert row["site_cpu_s_per_round"] > 0 and row["coordinator_cpu_s_per_round"] >= 0
    assert out.with_suffix(".png").stat().st_size > 0
