"""The main job end to end: `geodiloco demo --json` with real processes (short run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from geodiloco.app.demo import DemoOptions, demo_config
from geodiloco.coordinator.edge.server import initial_parameters

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_demo_writes_the_summary_and_beats_the_baseline_on_bytes(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "geodiloco",
            "demo",
            "--set",
            "rounds=2",
            "--run-dir",
            str(tmp_path / "run"),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "diloco round 2/2" in result.stdout and "baseline step 50/50" in result.stdout
    summary = json.loads(out.read_text())
    for key in ("sites", "ranks_per_site", "inner_steps", "rounds", "tokens", "wall_seconds"):
        assert key in summary
    assert (summary["sites"], summary["ranks_per_site"], summary["rounds"]) == (3, 2, 2)
    d, b = summary["diloco"], summary["baseline"]
    assert d["hashes_agree"] and d["tokens"] == b["tokens"] == summary["tokens"]
    assert 0 < d["final_eval_loss"] < 6 and 0 < b["final_eval_loss"] < 6
    cfg = demo_config(DemoOptions(overrides=["rounds=2"]))
    grads = initial_parameters(cfg).numel() * 4
    steps = 2 * cfg.inner.steps_per_round
    assert b["wan_bytes"] == 2 * (3 - 1) * steps * grads  # ring over 3 sites, fp32, every step
    # two 4-bit transfers per site per round (zstd may shave a little), plus headers and small RPCs
    assert (cfg.compression.uplink, cfg.compression.downlink) == ("q4|zstd:1", "q4|zstd:1")
    four_bit = 2 * 3 * 2 * grads / 8
    assert 0.8 * four_bit < d["wan_bytes"] < 1.1 * four_bit
    assert b["wan_bytes"] / d["wan_bytes"] >= 100
