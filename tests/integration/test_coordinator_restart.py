"""SIGKILL the coordinator in the middle of a run and restart it: no committed round is lost or
applied twice, and the sites (real processes) carry on to the end with identical parameters."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from geodiloco.app.status import fetch_status, request_shutdown
from geodiloco.testing.audits import ledger_problems, round_log
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.processes import kill_tree, serve_args, spawn_geodiloco
from geodiloco.testing.servers import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def serve(config: Path, port: int, run_dir: Path, log: Path) -> object:
    return spawn_geodiloco(serve_args(config, port, run_dir), log)


def test_coordinator_killed_mid_run_resumes_from_its_last_commit(tmp_path: Path) -> None:
    rounds = 8
    cfg = tiny_config(rounds=rounds, inner__steps_per_round=15, lease_s=30.0)
    config, run_dir, port = tmp_path / "run.json", tmp_path / "coord", free_port()
    config.write_text(cfg.to_json())
    target = f"127.0.0.1:{port}"
    coordinator = serve(config, port, run_dir, tmp_path / "coordinator-1.log")
    sites = [
        spawn_geodiloco(
            ["site", "run", "--name", n, "--coordinator", target, "--nproc", "2", "--insecure"],
            tmp_path / f"{n}.log",
        )
        for n in cfg.sites
    ]
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

        for name, proc in zip(cfg.sites, sites, strict=True):
            assert proc.wait(timeout=300) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
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
        for proc in (*sites, coordinator):
            if proc.poll() is None:
                kill_tree(proc)
