"""scripts/gpu_check.sh --smoke: every step of the GPU check on the CPU with tiny models, so that
the script and its JSON lines are known to work before a GPU runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.slow]
# benchmarks/inner.py's documented keys (issue 43)
INNER_KEYS = {
    "params",
    "device",
    "layout",
    "tokens_per_s_plain",
    "tokens_per_s_geodiloco",
    "ratio",
    "outer_sync_share",
    "peak_memory_bytes",
    "activation_checkpointing",
    "compile",
}


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_gpu_check_runs_every_step_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(tmp_path)}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=580,  # under pytest-timeout's 600 s: a loaded machine takes minutes
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    printed = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    kept = [line for name in sorted(tmp_path.glob("*.jsonl")) for line in lines(name)]
    assert sorted(map(json.dumps, printed)) == sorted(map(json.dumps, kept))  # one line per check, kept

    (tests,) = lines(tmp_path / "gpu-tests.jsonl")
    # the whole tree's gpu tests, beyond the two folders the check once ran; all skipped here
    assert tests["selected"] >= 28, tests
    assert {"tests/test_params.py", "tests/coordinator/test_outer_optimizer.py"} <= set(tests["files"]), tests
    assert tests["ok"] and tests["skipped"] == tests["selected"] and not tests["failed"]

    (bf16,) = lines(tmp_path / "agree-bf16.jsonl")
    assert bf16["ok"] and [r["round"] for r in bf16["rounds"]] == [0, 1]
    assert all(r["hash_reports"] == 2 and r["hashes_agree"] for r in bf16["rounds"])
    (fp8,) = lines(tmp_path / "agree-fp8.jsonl")
    assert fp8["skipped"].startswith("mixed-precision: fp8 needs a CUDA GPU")

    variants = {line["variant"]: line for line in lines(tmp_path / "one-rank.jsonl")}
    assert list(variants) == ["plain", "ddp", "fsdp", "ac-block", "ac-selective", "compile"]
    for name, line in variants.items():
        assert line["ok"] and line["steps"] == 4 and line["loss_last"] < line["loss_first"], line
        if name != "compile":  # fp32 on one rank: the same arithmetic, the same bits
            assert line["params_equal"] and line["max_rel_loss_diff"] == 0.0, line

    (ckpt,) = lines(tmp_path / "checkpoint.jsonl")
    assert ckpt["ok"] and ckpt["saved_round"] >= 1 and all(ckpt["loaded_equals_saved"].values()), ckpt
    assert [r["round"] for r in ckpt["rounds"]] == [0, 1, 2, 3]

    layouts = lines(tmp_path / "layouts.jsonl")
    assert [(r["layout"], r["ranks"], r["precision"]) for r in layouts] == [
        ("pp=2", 2, "fp32"),
        ("ep", 2, "bf16"),
    ]
    for run in layouts:
        assert run["ok"] and [r["round"] for r in run["rounds"]] == [0, 1], run
        assert all(r["hash_reports"] == 1 and r["hashes_agree"] for r in run["rounds"]), run

    inner = lines(tmp_path / "inner.jsonl")
    assert inner and all(r["ok"] and set(r) >= INNER_KEYS and r["device"] == "cpu" for r in inner), inner
