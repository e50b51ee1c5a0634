"""Streaming DiLoCo end to end over gRPC: a coordinator process keeping one round controller per
fragment and two real sites (torchrun, gloo) syncing P = 2 fragments with τ = 1 step of overlap.

Every fragment's round log is read from its own directory of the run directory; every site's
hash of every fragment of every round must match the coordinator's; the data ledger (settled by
the last fragment) must be consumed exactly once, through a coordinator SIGKILL and a site kill.

The sites of the first two tests (all agree; the coordinator killed) are the site daemon on real
gloo ranks from the test worker's pool of rank processes (tests/rank_pool.py); those killed or
partitioned are real `geodiloco site run` processes.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from geodiloco.app.status import fetch_status, request_shutdown
from geodiloco.app.wan import LinkConfig, ProxyThread
from geodiloco.config import RunConfig
from geodiloco.coordinator.fragment_rounds import PLAN_FILE, fragment_dir
from geodiloco.faults import FAULT_PLAN_ENV, Fault, FaultPlan, fired
from geodiloco.testing.audits import ledger_problems, round_log
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.processes import kill_tree, serve_args, spawn_geodiloco
from geodiloco.testing.rank_pool import RankPool, start_sites
from geodiloco.testing.servers import free_port

pytestmark = pytest.mark.integration

FRAGMENTS = 2


def streaming_config(**overrides: Any) -> RunConfig:
    settings: dict[str, Any] = {
        "rounds": 5,
        "min_sites": 2,  # every round waits for both sites (unless one is lost)
        "model__n_layer": 2,
        "inner__steps_per_round": 4,
        "outer__fragments": FRAGMENTS,
        "outer__overlap_steps": 1,
        "outer__mix_alpha": 0.5,
        **overrides,
    }
    return tiny_config(**settings)


class Run:
    """A coordinator (restartable on a fixed port) and the two sites of one run."""

    def __init__(
        self,
        tmp_path: Path,
        cfg: RunConfig,
        links: dict[str, ProxyThread] | None = None,
        port: int = 0,
        pool: RankPool | None = None,
    ) -> None:
        """``links``: a site reaches the coordinator through its WAN proxy there; ``pool``: the
        sites run on pooled ranks (not killed one by one), else as `geodiloco site run`."""
        self.tmp, self.cfg = tmp_path, cfg
        self.config, self.run_dir, self.port = tmp_path / "run.json", tmp_path / "coord", port or free_port()
        self.config.write_text(cfg.to_json())
        self.target = f"127.0.0.1:{self.port}"
        self.starts = 0
        self.coordinator = self.serve()
        self.pool = pool
        via = {name: proxy.address for name, proxy in (links or {}).items()}
        site = ["site", "run", "--nproc", "1", "--insecure", "--name"]
        if pool is not None:
            assert not via, "pooled sites reach the coordinator directly"
            start_sites(pool, self.target, dict.fromkeys(cfg.sites, (1, [])), tmp_path)
            self.sites = {}
            return
        self.sites = {
            name: spawn_geodiloco(
                [*site, name, "--coordinator", via.get(name, self.target)], tmp_path / f"{name}.log"
            )
            for name in cfg.sites
        }

    def serve(self) -> subprocess.Popen[bytes]:
        self.starts += 1
        log = self.tmp / f"coordinator-{self.starts}.log"
        return spawn_geodiloco(serve_args(self.config, self.port, self.run_dir), log)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()[-3000:]

    def fragment_log(self, p: int) -> list[dict[str, Any]]:
        return round_log(fragment_dir(self.run_dir, p))

    def reports(self, p: int) -> list[dict[str, Any]]:
        path = fragment_dir(self.run_dir, p) / "reports.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]

    def wait_rounds(self, rounds: int, timeout_s: float = 240) -> None:
        """Until the last fragment (the run's round) has committed ``rounds`` rounds."""
        deadline = time.monotonic() + timeout_s
        while len(self.fragment_log(FRAGMENTS - 1)) < rounds:
            assert time.monotonic() < deadline, self.log(f"coordinator-{self.starts}")
            time.sleep(0.05)

    def wait_sites(self, names: list[str], timeout_s: float = 240) -> None:
        if self.pool is not None:  # pooled sites end together
            assert sorted(names) == sorted(self.cfg.sites)
            self.pool.wait(timeout_s)
            return
        for name in names:
            assert self.sites[name].wait(timeout=timeout_s) == 0, self.log(name)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.abandon()
        for proc in (*self.sites.values(), self.coordinator):
            if proc.poll() is None:
                kill_tree(proc)


def assert_fragments_chained(run: Run, rounds: int) -> list[list[dict[str, Any]]]:
    """Every fragment committed rounds 0..rounds-1 once each, its log a hash chain."""
    logs = [run.fragment_log(p) for p in range(FRAGMENTS)]
    for log in logs:
        assert [r["round"] for r in log] == list(range(rounds))  # none lost or applied twice
        assert [r["base_hash"] for r in log[1:]] == [r["state_hash"] for r in log[:-1]]
    assert ledger_problems(logs[-1], run.cfg) == []  # the run's data: the last fragment's
    return logs


def test_two_sites_stream_two_fragments_and_agree_on_every_hash(rank_pool: RankPool, tmp_path: Path) -> None:
    cfg = streaming_config()
    run = Run(tmp_path, cfg, pool=rank_pool)
    try:
        run.wait_sites(list(cfg.sites))
        assert (run.run_dir / PLAN_FILE).exists() and not (run.run_dir / "rounds.jsonl").exists()
        logs = assert_fragments_chained(run, cfg.rounds)
        for p, log in enumerate(logs):
            assert all(sorted(r["contributors"]) == ["site-a", "site-b"] for r in log)
            reports = {(r["round"], r["site"]): r["hash_ok"] for r in run.reports(p)}
            expected = {(r, s) for r in range(cfg.rounds) for s in cfg.sites}
            assert set(reports) == expected, f"fragment {p}: reports {sorted(reports)}"
            assert all(reports.values()), f"fragment {p}: a site's hash differed"
        status = fetch_status(run.target, None)
        assert status.finished and status.round == cfg.rounds
        assert all(h.hashes_agree and h.hash_reports == 2 for h in status.history)
        for site in status.sites:
            assert site.state == "left" and site.accepted == cfg.rounds and site.hash_ok
        request_shutdown(run.target, None)
        assert run.coordinator.wait(timeout=30) == 0
    finally:
        run.close()


def test_a_coordinator_killed_mid_run_resumes_every_fragment(rank_pool: RankPool, tmp_path: Path) -> None:
    cfg = streaming_config(rounds=6, lease_s=30.0)
    run = Run(tmp_path, cfg, pool=rank_pool)
    try:
        run.wait_rounds(2)
        run.coordinator.send_signal(signal.SIGKILL)
        run.coordinator.wait()
        killed_at = [len(run.fragment_log(p)) for p in range(FRAGMENTS)]
        assert max(killed_at) < cfg.rounds
        run.coordinator = run.serve()
        run.wait_sites(list(cfg.sites))
        assert_fragments_chained(run, cfg.rounds)  # each fragment resumed bit exact: an unbroken chain
        restarted = (tmp_path / "coordinator-2.log").read_text()
        assert restarted.count("resumed run test-run at round") == FRAGMENTS
        for p in range(FRAGMENTS):  # the sites' hashes agree with the resumed fragments too
            late = [r for r in run.reports(p) if r["round"] >= killed_at[p]]
            assert late and all(r["hash_ok"] for r in late), f"fragment {p}"
        status = fetch_status(run.target, None)
        assert status.finished and all(site.hash_ok for site in status.sites)
        request_shutdown(run.target, None)
        assert run.coordinator.wait(timeout=30) == 0
    finally:
        run.close()


def test_a_site_killed_mid_run_costs_only_its_contribution(tmp_path: Path) -> None:
    cfg = streaming_config(rounds=6, min_sites=1, lease_s=3.0, round_timeout_s=5.0)
    run = Run(tmp_path, cfg)
    try:
        run.wait_rounds(2)
        kill_tree(run.sites["site-b"])
        run.sites["site-b"].wait()
        run.wait_sites(["site-a"])
        logs = assert_fragments_chained(run, cfg.rounds)
        for log in logs:  # site-b's rounds before the kill counted; after it, site-a's alone
            assert sorted(log[0]["contributors"]) == ["site-a", "site-b"]
            assert log[-1]["contributors"] == ["site-a"]
        finals = [r for p in range(FRAGMENTS) for r in run.reports(p) if r["site"] == "site-a"]
        assert all(r["hash_ok"] for r in finals)
        status = fetch_status(run.target, None)
        assert status.finished
        states = {s.site: s.state for s in status.sites}
        assert states == {"site-a": "left", "site-b": "lost"}
        request_shutdown(run.target, None)
        assert run.coordinator.wait(timeout=30) == 0
    finally:
        run.close()


def test_a_partitioned_site_is_lost_then_rejoins_and_catches_up_every_fragment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """site-b's WAN link is cut past its lease in round 2: the run goes on with site-a, and once
    the link heals site-b rejoins, catches every fragment up and contributes again. Both sites
    are behind a 100 ms round trip, so the rounds after the cut outlast it."""
    lease_s = 2.0
    cfg = streaming_config(rounds=16, min_sites=1, lease_s=lease_s, round_timeout_s=5.0)
    port = free_port()
    proxies = {
        n: ProxyThread(f"127.0.0.1:{port}", LinkConfig(latency_ms=50), control_port=0) for n in cfg.sites
    }
    plan = tmp_path / "plan.json"
    monkeypatch.setenv(FAULT_PLAN_ENV, str(plan))
    partition = Fault(action="partition", site="site-b", round=2, step=1, seconds=lease_s + 1)
    FaultPlan(faults=[partition], links={"site-b": proxies["site-b"].control_address}).write(plan)
    run = None
    try:
        run = Run(tmp_path, cfg, proxies, port=port)
        run.wait_sites(list(cfg.sites), timeout_s=240)
        assert fired(plan), "the partition never fired"
        logs = assert_fragments_chained(run, cfg.rounds)
        for p, log in enumerate(logs):
            # the run did not wait for the partitioned site ...
            alone = [r["round"] for r in log if r["contributors"] == ["site-a"]]
            assert alone, f"fragment {p}: no round closed without site-b"
            # ... and once back, it contributed again and its hashes agreed
            back = [r["round"] for r in log if r["round"] > alone[0] and "site-b" in r["contributors"]]
            assert back, f"fragment {p}: site-b never contributed after the partition"
            reports = [r for r in run.reports(p) if r["site"] == "site-b" and r["round"] >= back[0]]
            assert reports and all(r["hash_ok"] for r in reports), f"fragment {p}"
        status = {s.site: s for s in fetch_status(run.target, None).sites}
        assert status["site-b"].state == "left" and status["site-b"].hash_ok  # every fragment's last report
        request_shutdown(run.target, None)
        assert run.coordinator.wait(timeout=30) == 0
    finally:
        if run is not None:
            run.close()
        for proxy in proxies.values():
            proxy.close()
