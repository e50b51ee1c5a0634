"""The synchronous baseline counts the bytes it really all-reduces."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from geodiloco.app.baseline import cross_site_bytes
from geodiloco.coordinator.edge.server import initial_parameters
from geodiloco.site.daemon.launcher import worker_command, worker_env
from geodiloco.testing.configs import tiny_config


def test_ring_over_sites_formula() -> None:
    assert cross_site_bytes(1000, sites=1) == 0
    assert cross_site_bytes(1000, sites=3) == 4000  # each of 3 leaders sends 2*(2/3)*1000


@pytest.mark.integration
def test_baseline_allreduces_every_gradient_every_step(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=2, sites=["a", "b"])
    (tmp_path / "run.json").write_text(cfg.to_json())
    out = tmp_path / "baseline.json"
    cmd = worker_command(
        "geodiloco.app.baseline",
        4,
        ["--config", str(tmp_path / "run.json"), "--ranks-per-site", "2", "--out", str(out)],
    )
    run = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(out.read_text())
    steps = cfg.rounds * cfg.inner.steps_per_round
    fp32_grads = initial_parameters(cfg).numel() * 4
    assert result["allreduced_bytes_per_rank"] == steps * fp32_grads
    assert result["wan_bytes"] == 2 * (2 - 1) * steps * fp32_grads
    assert result["tokens"] == steps * 4 * cfg.data.batch_size * cfg.model.seq_len
    assert len(result["curve"]) == cfg.rounds


@pytest.mark.integration
def test_baseline_trains_the_runs_mixture_of_experts(tmp_path: Path) -> None:
    """model.experts reaches the baseline: it all-reduces the mixture of experts' gradients (the
    dense model's would be another size) and trains it."""
    cfg = tiny_config(rounds=2, sites=["a", "b"], model__experts=4, model__top_k=2)
    (tmp_path / "run.json").write_text(cfg.to_json())
    out = tmp_path / "baseline.json"
    cmd = worker_command(
        "geodiloco.app.baseline",
        2,
        ["--config", str(tmp_path / "run.json"), "--ranks-per-site", "1", "--out", str(out)],
    )
    run = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(out.read_text())
    steps = cfg.rounds * cfg.inner.steps_per_round
    moe_params = initial_parameters(cfg).numel()
    assert moe_params != initial_parameters(tiny_config()).numel()
    assert result["allreduced_bytes_per_rank"] == steps * moe_params * 4
    assert [p["step"] for p in result["curve"]] == [3, 6]
    assert all(0 < p["eval_loss"] < 6 for p in result["curve"])
