"""Smoke run of benchmarks/stream_window.py: one stream per latency, every byte through the proxy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "stream_window.py"


def test_stream_window_smoke_streams_every_byte_at_each_latency(tmp_path: Path) -> None:
    out = tmp_path / "window.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--json", str(out)], capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    rows = json.loads(out.read_text())
    assert [r["latency_ms"] for r in rows] == [0.0, 50.0]
    assert all(r["bytes"] == 8 << 20 and r["mb_per_s"] > 0 for r in rows)
    assert rows[1]["seconds"] >= 0.05  # the first byte crossed the emulated latency
