"""Chaos: real processes through WAN proxies, with faults placed by a fault plan at (site, rank,
round, step or chunk of a push), so each lands at the same point of training in every run: a
site SIGKILLed mid-round (and restarted, as a supervisor would), the coordinator SIGKILLed in the
middle of a site's push (and restarted), a site partitioned past its lease and healed, a link
slowed, and a link reset."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from geodiloco.app.status import fetch_status, request_shutdown
from geodiloco.app.wan import LinkConfig, ProxyThread
from geodiloco.config import RunConfig
from geodiloco.faults import FAULT_PLAN_ENV, Fault, FaultPlan, fired
from geodiloco.testing.audits import ledger_problems, round_log
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.processes import kill_tree, serve_args, spawn_geodiloco
from geodiloco.testing.servers import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Enough that the run is still going after the partition (round 4, the lease and 2 s) has healed
# and when the site killed in round 11 restarts (on a loaded machine it may find the run over,
# join and leave: assert_no_round_lost allows it). Measured with 40 rounds: from round 15 on, the
# chaos run's eval loss stayed within 2% of the calm run's (the bound below allows 10%).
ROUNDS = 20
LEASE_S = 8.0
# site-1 runs 2 ranks, for the kill of its rank 1 mid-training (the site fails as a whole); the
# partition, the delay and the coordinator kill mid-push need no more than one rank at their sites
RANKS = {"site-1": 2, "site-2": 1, "site-3": 1}


def chaos_config() -> RunConfig:
    return tiny_config(  # min_sites left at its default: 2 of the 3 sites
        sites=["site-1", "site-2", "site-3"],
        rounds=ROUNDS,
        inner__steps_per_round=12,
        lease_s=LEASE_S,
        heartbeat_interval_s=0.5,
        round_timeout_s=20.0,
        compression__chunk_elements=1024,  # a few chunks per push and pull, to place faults between
    )


def chaos_faults() -> list[Fault]:
    # the site kill comes last: on a loaded machine a restarted site takes longer than the rest
    # of the faults, and a quorum short of it would hide what the partition shows
    return [
        Fault(action="kill", site="site-3", round=2, at="push", chunk=2, target="coordinator"),  # mid-push
        Fault(action="partition", site="site-2", round=4, step=3, seconds=LEASE_S + 2),  # past its lease
        Fault(action="delay", site="site-3", round=7, step=0, delay_ms=200, seconds=3),
        Fault(action="drop", site="site-1", round=9, step=2),  # every connection reset
        Fault(action="kill", site="site-1", rank=1, round=11, step=5),  # a site, mid-training
    ]


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def run(
    tmp_path: Path,
    faults: list[Fault],
    monkeypatch: pytest.MonkeyPatch,
    cfg: RunConfig | None = None,
    nproc: dict[str, int] | None = None,
) -> tuple[list[dict], Any, dict[str, int]]:
    """Run ``cfg`` with every process restarted when it dies (a supervisor); returns the round
    log, the final status and how often each process was restarted. ``nproc``: ranks per site
    (default :data:`RANKS`)."""
    ranks = nproc or RANKS
    cfg = cfg or chaos_config()
    config, run_dir, port = tmp_path / "run.json", tmp_path / "coord", free_port()
    config.write_text(cfg.to_json())
    target = f"127.0.0.1:{port}"
    serve = serve_args(config, port, run_dir)
    plan = tmp_path / "plan.json"
    if faults:
        monkeypatch.setenv(FAULT_PLAN_ENV, str(plan))  # the sites and the coordinator read it
    proxies = {name: ProxyThread(target, LinkConfig(latency_ms=5), control_port=0) for name in cfg.sites}
    links = {name: proxy.control_address for name, proxy in proxies.items()}

    def start_coordinator() -> subprocess.Popen[bytes]:
        proc = spawn_geodiloco(serve, tmp_path / "coordinator.log")
        if faults:  # its pid for the sites' kills, rewritten at every restart
            FaultPlan(faults=faults, links=links, coordinator_pid=proc.pid).write(plan)
        return proc

    def start_site(name: str) -> subprocess.Popen[bytes]:
        args = [
            "site",
            "run",
            "--name",
            name,
            "--coordinator",
            proxies[name].address,
            "--nproc",
            str(ranks[name]),
            "--insecure",
        ]
        return spawn_geodiloco(args, tmp_path / f"{name}.log")

    coordinator = start_coordinator()
    sites = {name: start_site(name) for name in cfg.sites}
    restarts = dict.fromkeys([*cfg.sites, "coordinator"], 0)
    try:
        deadline = time.monotonic() + 500
        while any(proc.poll() != 0 for proc in sites.values()):  # a supervisor: restart what died
            assert time.monotonic() < deadline, "timed out waiting for the sites to finish"
            if coordinator.poll() is not None:
                coordinator = start_coordinator()
                restarts["coordinator"] += 1
            for name, proc in sites.items():
                if proc.poll() not in (None, 0):
                    sites[name] = start_site(name)
                    restarts[name] += 1
            assert max(restarts.values()) <= 2, (
                restarts,
                [(tmp_path / f"{n}.log").read_text()[-2000:] for n in sites],
            )
            time.sleep(0.1)
        status = fetch_status(target, None)
        request_shutdown(target, None)
        coordinator.wait(timeout=30)
        return round_log(run_dir), status, restarts
    finally:
        for proc in (*sites.values(), coordinator):
            if proc.poll() is None:
                kill_tree(proc)
        for proxy in proxies.values():
            proxy.close()


def assert_no_round_lost(log: list[dict], status: Any, rounds: int) -> None:
    assert status.finished and status.round == rounds
    assert [r["round"] for r in log] == list(range(rounds))  # no round lost or applied twice
    assert len({r["state_hash"] for r in log}) == rounds
    assert [r["base_hash"] for r in log[1:]] == [r["state_hash"] for r in log[:-1]]  # a chain
    assert [h.state_hash for h in status.history] == [r["state_hash"] for r in log]
    assert all(site.hash_ok for site in status.sites), status.sites
    # every site that trained the last round finished on the coordinator's final parameters (a
    # site restarted late on a loaded machine may find the run over, join and leave)
    finishers = [site for site in status.sites if site.last_round == rounds - 1]
    assert len(finishers) >= 2 and all(s.last_report_round == rounds - 1 for s in finishers), status.sites


def test_the_run_survives_faults_placed_by_a_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "calm").mkdir(), (tmp_path / "chaos").mkdir()
    _, calm, calm_restarts = run(tmp_path / "calm", [], monkeypatch)
    assert calm_restarts == dict.fromkeys(calm_restarts, 0)
    faults = chaos_faults()
    log, status, restarts = run(tmp_path / "chaos", faults, monkeypatch)
    assert restarts == {"site-1": 1, "site-2": 0, "site-3": 0, "coordinator": 1}, restarts

    # every fault fired once, exactly where it was placed
    records = fired(tmp_path / "chaos" / "plan.json")
    assert [(r["round"], r["step"]) for _, r in sorted(records.items())] == [f.position for f in faults]

    assert_no_round_lost(log, status, ROUNDS)
    assert "resumed run test-run" in (tmp_path / "chaos" / "coordinator.log").read_text()
    assert ledger_problems(log, chaos_config()) == []
    assert any("site-2" not in r["contributors"] for r in log[4:7])  # the partition outlasted its lease
    final, calm_final = status.history[-1].eval_loss, calm.history[-1].eval_loss
    assert final <= calm_final * 1.10, (final, calm_final)


def test_sites_retry_through_a_coordinator_that_dies_by_an_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 16 item 6: the coordinator raises inside two commits (the round advanced in memory,
    not yet durable) and exits; its open calls end UNKNOWN or CANCELLED, not UNAVAILABLE. The
    sites retry until it is restarted, push again what it lost, and the run finishes."""
    rounds = 5
    cfg = tiny_config(
        sites=["site-1", "site-2"],
        rounds=rounds,
        min_sites=2,  # both contribute to every round: a commit always has a pusher and a puller
        inner__steps_per_round=4,
        lease_s=LEASE_S,
        heartbeat_interval_s=0.5,
        round_timeout_s=20.0,
    )
    faults = [
        Fault(action="raise", round=1, at="commit", target="coordinator"),
        Fault(action="raise", round=3, at="commit", target="coordinator"),
    ]
    log, status, restarts = run(tmp_path, faults, monkeypatch, cfg, nproc=dict.fromkeys(cfg.sites, 1))
    assert sorted(fired(tmp_path / "plan.json")) == [0, 1]
    died = re.findall(
        r"^fault plan: raise at commit of round (\d+)$", (tmp_path / "coordinator.log").read_text(), re.M
    )
    assert died == ["1", "3"]  # the uncaught exception ended the process, twice
    assert restarts == {"site-1": 0, "site-2": 0, "coordinator": 2}, restarts
    assert_no_round_lost(log, status, rounds)
    assert ledger_problems(log, cfg) == []
