"""scripts/gpu_check.sh --smoke: the GPU check's steps on the CPU with tiny models, so that the
script and its JSON lines are known to work before a GPU runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_gpu_check_runs_its_steps_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(tmp_path)}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=580,  # under pytest-timeout's 600 s: a loaded machine takes minutes
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    bf16 = json.loads((tmp_path / "agree-bf16.json").read_text())
    assert bf16["ok"] and [r["round"] for r in bf16["rounds"]] == [0, 1]
    assert all(r["hash_reports"] == 2 and r["hashes_agree"] for r in bf16["rounds"])
    fp8 = json.loads((tmp_path / "agree-fp8.json").read_text())
    assert fp8["skipped"].startswith("mixed-precision: fp8 needs a CUDA GPU")
    layouts = [json.loads(line) for line in (tmp_path / "layouts.jsonl").read_text().splitlines()]
    assert [(r["layout"], r["ranks"], r["precision"]) for r in layouts] == [
        ("pp=2", 2, "fp32"),
        ("ep", 2, "bf16"),
    ]
    for run in layouts:
        assert run["ok"] and [r["round"] for r in run["rounds"]] == [0, 1], run
        assert all(r["hash_reports"] == 1 and r["hashes_agree"] for r in run["rounds"]), run
    rate = json.loads((tmp_path / "throughput.json").read_text())
    assert set(rate) == {
        "check",
        "device",
        "precision",
        "params",
        "inner_steps_per_round",
        "measured_rounds",
        "tokens_per_s_inner_only",
        "tokens_per_s_with_outer_sync",
        "outer_sync_share",
    }
    assert rate["measured_rounds"] == 2 and 0 < rate["outer_sync_share"] < 1
    assert rate["tokens_per_s_inner_only"] > rate["tokens_per_s_with_outer_sync"] > 0
    assert (
        "passed" in (tmp_path / "gpu-tests.txt").read_text()
        or "skipped" in (tmp_path / "gpu-tests.txt").read_text()
    )
