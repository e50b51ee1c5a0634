"""The synchronous baseline counts the bytes it really all-reduces.

Its ranks run in pooled gloo processes (tests/rank_pool.py), each given the environment torchrun
gives a rank; the demo's test runs it under torchrun itself (tests/integration/test_demo.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from geodiloco.app.baseline import cross_site_bytes
from geodiloco.coordinator.edge.server import initial_parameters
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.rank_pool import RankPool
from geodiloco.testing.servers import free_port


def _baseline_rank(rank: int, world: int, port: int, argv: list[str], out: Any) -> None:
    """One rank of `geodiloco.app.baseline`, in the environment torchrun would give it."""
    from geodiloco.app import baseline

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    baseline.main(argv)
    out.put({"rank": rank})


def run_baseline(pool: RankPool, world: int, argv: list[str]) -> None:
    port = free_port()
    pool.run(_baseline_rank, [(r, world, port, argv) for r in range(world)], timeout=180)


def test_ring_over_sites_formula() -> None:
    assert cross_site_bytes(1000, sites=1) == 0
    assert cross_site_bytes(1000, sites=3) == 4000  # each of 3 leaders sends 2*(2/3)*1000


@pytest.mark.integration
def test_baseline_allreduces_every_gradient_every_step(rank_pool: RankPool, tmp_path: Path) -> None:
    cfg = tiny_config(rounds=2, sites=["a", "b"])
    (tmp_path / "run.json").write_text(cfg.to_json())
    out = tmp_path / "baseline.json"
    run_baseline(
        rank_pool, 4, ["--config", str(tmp_path / "run.json"), "--ranks-per-site", "2", "--out", str(out)]
    )
    result = json.loads(out.read_text())
    steps = cfg.rounds * cfg.inner.steps_per_round
    fp32_grads = initial_parameters(cfg).numel() * 4
    assert result["allreduced_bytes_per_rank"] == steps * fp32_grads
    assert result["wan_bytes"] == 2 * (2 - 1) * steps * fp32_grads
    assert result["tokens"] == steps * 4 * cfg.data.batch_size * cfg.model.seq_len
    assert len(result["curve"]) == cfg.rounds


@pytest.mark.integration
def test_baseline_trains_the_runs_mixture_of_experts(rank_pool: RankPool, tmp_path: Path) -> None:
    """model.experts reaches the baseline: it all-reduces the mixture of experts' gradients (the
    dense model's would be another size) and trains it."""
    cfg = tiny_config(rounds=2, sites=["a", "b"], model__experts=4, model__top_k=2)
    (tmp_path / "run.json").write_text(cfg.to_json())
    out = tmp_path / "baseline.json"
    run_baseline(
        rank_pool, 2, ["--config", str(tmp_path / "run.json"), "--ranks-per-site", "1", "--out", str(out)]
    )
    result = json.loads(out.read_text())
    steps = cfg.rounds * cfg.inner.steps_per_round
    moe_params = initial_parameters(cfg).numel()
    assert moe_params != initial_parameters(tiny_config()).numel()
    assert result["allreduced_bytes_per_rank"] == steps * moe_params * 4
    assert [p["step"] for p in result["curve"]] == [3, 6]
    assert all(0 < p["eval_loss"] < 6 for p in result["curve"])
