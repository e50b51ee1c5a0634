"""SIGKILL the coordinator in the middle of a run and restart it: no committed round is lost or
applied twice, and the sites (real processes) carry on to the end with identical parameters.

Each site is the site daemon on 2 real gloo ranks from the test worker's pool of rank processes
(tests/rank_pool.py); the coordinator is the process killed and restarted."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from geodiloco.app.status import fetch_status, request_shutdown
from geodiloco.testing.audits import ledger_problems, round_log
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.processes import kill_tree, serve_args, spawn_geodiloco
from geodiloco.testing.rank_pool import RankPool, start_sites
from geodiloco.testing.servers import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def serve(config: Path, port: int, run_dir: Path, log: Path) -> object:
    return spawn_geodiloco(serve_args(config, port, run_dir), log)


def test_coordinator_killed_mid_run_resumes_from_its_last_commit(rank_pool: RankPool, tmp_path: Path) -> None:
    rounds = 8
    cfg = tiny_config(rounds=rounds, inner__steps_per_round=15, lease_s=30.0)
    config, run_dir, port = tmp_path / "run.json", tmp_path / "coord", free_port()
    config.write_text(cfg.to_json())
    target = f"127.0.0.1:{port}"
    coordinator = serve(config, port, run_dir, tmp_path / "coordinator-1.log")
    start_sites(rank_pool, target, dict.fromkeys(cfg.sites, (2, [])), tmp_path)
    try:
        deadline = time.monotonic() + 180
        while len(round_log(run_dir)) < 3:
            assert time.monotonic() < deadline, (tmp_path / "coordinator-1.log").read_text()[-2000:]
            time.sleep(0.05)
        coordinator.send_signal(signal.SIGKILL)
        coordinator.wait()
        killed_at = len(round_log(run_dir))
        assert killed_at < rounds
        coordinator = serve(config, port, run_dir, tmp_path / "coordinator-2.log")

        rank_pool.wait(300)  # every rank of both sites left the run
        log = round_log(run_dir)
        assert [r["round"] for r in log] == list(range(rounds))  # contiguous, none lost or repeated
        assert len({r["state_hash"] for r in log}) == rounds
        assert [r["base_hash"] for r in log[1:]] == [r["state_hash"] for r in log[:-1]]  # a chain
        assert ledger_problems(log, cfg) == []
        restarted = (tmp_path / "coordinator-2.log").read_text()
        assert "resumed run test-run at round" in restarted
        # the restart logs its phases, and builds neither the model nor the data (issue 16)
        assert "ready to serve at round" in restarted and "state and replay" in restarted
        assert "model and data" not in restarted
        status = fetch_status(target, None)
        assert status.finished and status.round == rounds
        assert [h.state_hash for h in status.history] == [r["state_hash"] for r in log]
        for site in status.sites:
            assert site.hash_ok and site.last_report_round == rounds - 1 and site.state == "left"
        request_shutdown(target, None)
        assert coordinator.wait(timeout=30) == 0
    finally:
        rank_pool.abandon()
        if coordinator.poll() is None:
            kill_tree(coordinator)
