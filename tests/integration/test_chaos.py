"""Chaos: real processes through WAN proxies, with a site SIGKILLed and restarted, another
partitioned past its lease and healed, and the coordinator SIGKILLed and restarted."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from geodiloco.config import RunConfig
from geodiloco.status import fetch_status, request_shutdown
from geodiloco.wan import LinkConfig, ProxyThread
from helpers import (
    free_port,
    kill_tree,
    ledger_problems,
    round_log,
    serve_args,
    spawn_geodiloco,
    tiny_config,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROUNDS = 40  # enough that the run is still going after the partition has healed


def chaos_config() -> RunConfig:
    return tiny_config(
        sites=["site-1", "site-2", "site-3"],
        rounds=ROUNDS,
        min_sites=1,
        inner__steps_per_round=12,
        lease_s=8.0,
        heartbeat_interval_s=0.5,
        round_timeout_s=20.0,
    )


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def run(tmp_path: Path, chaos: bool) -> tuple[list[dict], object]:
    cfg = chaos_config()
    config, run_dir, port = tmp_path / "run.json", tmp_path / "coord", free_port()
    config.write_text(cfg.to_json())
    target = f"127.0.0.1:{port}"
    serve = serve_args(config, port, run_dir)
    coordinator = spawn_geodiloco(serve, tmp_path / "coordinator.log")
    proxies = {name: ProxyThread(target, LinkConfig(latency_ms=5)) for name in cfg.sites}

    def start_site(name: str) -> subprocess.Popen[bytes]:
        args = [
            "site",
            "run",
            "--name",
            name,
            "--coordinator",
            proxies[name].address,
            "--nproc",
            "2",
            "--insecure",
        ]
        return spawn_geodiloco(args, tmp_path / f"{name}.log")

    sites = {name: start_site(name) for name in cfg.sites}
    try:
        if chaos:
            wait_until(lambda: len(round_log(run_dir)) >= 2, 180, "round 2")
            kill_tree(sites["site-1"])  # mid-round: training, pushing or waiting for the update
            sites["site-1"] = start_site("site-1")
            wait_until(lambda: len(round_log(run_dir)) >= 4, 180, "round 4")
            coordinator.send_signal(signal.SIGKILL)  # wherever it is: serving, committing, idle
            coordinator.wait()
            coordinator = spawn_geodiloco(serve, tmp_path / "coordinator.log")
            wait_until(lambda: len(round_log(run_dir)) >= 6, 180, "round 6")
            proxies["site-2"].partition()
            time.sleep(cfg.lease_s + 2)  # longer than its lease: the others go on without it
            proxies["site-2"].heal()
            assert len(round_log(run_dir)) < ROUNDS - 5, "the run ended before the partition healed"
        for name, proc in sites.items():
            assert proc.wait(timeout=400) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        status = fetch_status(target, None)
        request_shutdown(target, None)
        coordinator.wait(timeout=30)
        return round_log(run_dir), status
    finally:
        for proc in (*sites.values(), coordinator):
            if proc.poll() is None:
                kill_tree(proc)
        for proxy in proxies.values():
            proxy.close()


def test_the_run_survives_site_death_partition_and_coordinator_death(tmp_path: Path) -> None:
    (tmp_path / "calm").mkdir(), (tmp_path / "chaos").mkdir()
    _, calm = run(tmp_path / "calm", chaos=False)
    log, status = run(tmp_path / "chaos", chaos=True)

    assert status.finished and status.round == ROUNDS
    assert [r["round"] for r in log] == list(range(ROUNDS))  # no round lost or applied twice
    assert len({r["state_hash"] for r in log}) == ROUNDS
    assert [r["base_hash"] for r in log[1:]] == [r["state_hash"] for r in log[:-1]]  # a chain
    assert [h.state_hash for h in status.history] == [r["state_hash"] for r in log]
    assert "resumed run test-run" in (tmp_path / "chaos" / "coordinator.log").read_text()
    for site in status.sites:  # every site finished on the coordinator's final parameters
        assert site.hash_ok and site.last_report_round == ROUNDS - 1, site
    assert ledger_problems(log, chaos_config()) == []
    assert any(len(r["contributors"]) < 3 for r in log)  # some round really went on without a site
    final, calm_final = status.history[-1].eval_loss, calm.history[-1].eval_loss
    assert final <= calm_final * 1.10, (final, calm_final)
