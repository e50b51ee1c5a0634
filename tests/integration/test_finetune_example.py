"""examples/finetune_hf.py runs for real (short): a HF model fine-tuned across two sites on text
files, exported with `geodiloco export` and reloaded with transformers, its loss lower after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "finetune_hf.py"


def test_finetune_example_lowers_the_held_out_loss_and_exports_a_transformers_model(tmp_path: Path) -> None:
    args = ["--workdir", str(tmp_path), "--rounds", "2", "--pretrain-steps", "20"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=900, env=env
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["loss_after"] < summary["loss_before"], summary
    assert (tmp_path / "exported" / "config.json").is_file()
    assert json.loads((tmp_path / "exported" / "geodiloco-export.json").read_text())["round"] == 2
    reports = [json.loads(line) for line in (tmp_path / "coord" / "reports.jsonl").read_text().splitlines()]
    assert len(reports) == 4 and all(r["hash_ok"] for r in reports)  # 2 rounds x 2 sites
