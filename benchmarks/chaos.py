"""Chaos soak (issue 16): a long run of real processes under a fault plan, against a fault-free
run of the same seed. A coordinator process and site processes (torchrun, gloo) on loopback,
each site behind its own ``geodiloco wan`` proxy; a supervisor restarts whatever dies.

The plan (placed by round and chunk, see :mod:`geodiloco.faults`) covers site SIGKILLs at
commit, mid-push and mid-pull; coordinator SIGKILLs at commit, mid-push and mid-pull; a
coordinator that dies by an exception at commit; a partition longer than the lease; and one
site on a slow link that moves less than the full state per lease (so its resync after the
partition crosses it). Prints and writes as JSON (``--json PATH``):

- rounds committed, rounds lost (must be 0), hash mismatches (sites whose final hash differs,
  breaks of the round log's hash chain), the ledger audit (every data window consumed once);
- per fault: where it fired, and the longest stall of the healthy sites it caused (the longest
  gap between commits from the moment it fired until the next fault fired, a gap that the next
  fault's firing interrupts counted up to that moment); the typical round (the median gap
  between commits) and the longest stall less it, what a fault added to a round;
- per coordinator death: seconds from its restart to serving, and to the next commit;
- the final eval loss against the fault-free run's.

    python benchmarks/chaos.py [--json PATH] [--rounds 60] [--keep DIR] [--smoke]

``--smoke`` (8 rounds, a site SIGKILL mid-push and a coordinator raise at commit, no slow link)
checks that the benchmark still runs. Commit times are observed by polling the round log every
50 ms, so the stalls carry up to 50 ms of observation delay; a stall includes the round's own
training and transfer time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from geodiloco.app.status import fetch_status, request_shutdown
from geodiloco.app.wan import LinkConfig, ProxyThread
from geodiloco.config import RunConfig
from geodiloco.coordinator.edge.server import data_shard_sizes
from geodiloco.coordinator.ledger import ConsumedRecord, check_exactly_once
from geodiloco.faults import FAULT_PLAN_ENV, Fault, FaultPlan, fired
from geodiloco.testing.processes import kill_tree, spawn_geodiloco
from geodiloco.workload.data import DataRange

POLL_S = 0.05
SITES = ("site-1", "site-2", "site-3")
SLOW_SITE = "site-3"


@dataclass(kw_only=True, slots=True)
class Settings:
    """The run (small, so that it fits a shared 2-core machine)."""

    rounds: int = 60
    steps_per_round: int = 4
    lease_s: float = 6.0
    heartbeat_interval_s: float = 0.5
    round_timeout_s: float = 20.0
    chunk_elements: int = 2048  # several chunks per push and pull, to place faults between
    latency_ms: float = 5.0
    smoke: bool = False
    slow_link: bool = True  # with faults: site-3 behind a slow link (benchmarks/hetero.py: only in c)
    timeout_s: float = 3000.0
    sites: tuple[str, ...] = SITES  # benchmarks/robust.py: 3 or 4

    def run_config(self) -> RunConfig:
        return RunConfig.from_dict(
            {
                "run_id": "chaos-bench",
                "sites": list(self.sites),
                "rounds": self.rounds,
                "seed": 0,
                "lease_s": self.lease_s,
                "heartbeat_interval_s": self.heartbeat_interval_s,
                "round_timeout_s": self.round_timeout_s,
                "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 16},
                "data": {"max_bytes": 300_000, "batch_size": 4, "eval_sequences": 16},
                "inner": {"steps_per_round": self.steps_per_round, "lr": 3e-3},
                "outer": {"optimizer": "nesterov", "lr": 0.7, "momentum": 0.5},
                "compression": {"chunk_elements": self.chunk_elements},
            }
        )

    def faults(self) -> list[Fault]:
        if self.smoke:
            return [
                Fault(action="kill", site="site-2", round=2, at="push", chunk=2),
                Fault(action="raise", round=4, at="commit", target="coordinator"),
            ]
        every = max(self.rounds // 12, 3)  # spread over the run, the last well before its end
        r = [every * (i + 1) for i in range(10)]
        return [
            Fault(action="kill", site="site-1", round=r[0], at="pull", chunk=0),  # site at commit
            Fault(action="kill", site="site-2", round=r[1], at="push", chunk=2),  # site mid-push
            Fault(action="kill", site="site-1", round=r[2], at="pull", chunk=2),  # site mid-pull
            Fault(action="kill", round=r[3], at="commit", target="coordinator"),
            Fault(action="kill", site="site-1", round=r[4], at="push", chunk=2, target="coordinator"),
            Fault(action="kill", site="site-2", round=r[5], at="pull", chunk=2, target="coordinator"),
            Fault(action="raise", round=r[6], at="commit", target="coordinator"),
            # past its lease; it resyncs the full state over its slow link
            Fault(action="partition", site=SLOW_SITE, round=r[7], step=1, seconds=self.lease_s + 4),
            Fault(action="delay", site="site-2", round=r[8], step=1, delay_ms=300, seconds=4),
            Fault(action="drop", site="site-1", round=r[9], step=1),
        ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def state_bytes(cfg: RunConfig) -> int:
    from geodiloco.coordinator.edge.server import initial_parameters

    return 4 * initial_parameters(cfg).numel()


def slow_link_mbps(settings: Settings, cfg: RunConfig) -> float:
    """A link that moves 2/3 of the full state per lease: a full-state pull outlasts the lease."""
    return state_bytes(cfg) * 8 / (1.5 * settings.lease_s) / 1e6


class Soak:
    """One run under a supervisor; with ``faults`` its plan is in every process's environment."""

    def __init__(self, settings: Settings, workdir: Path, faults: list[Fault]) -> None:
        self.s, self.workdir, self.faults = settings, workdir, faults
        self.cfg = settings.run_config()
        self.run_dir = workdir / "coord"
        config = workdir / "run.json"
        config.write_text(self.cfg.to_json())
        self.plan = workdir / "plan.json"
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.serve_args = ["coordinator", "serve", "--config", str(config), "--port", str(self.port)]
        self.serve_args += ["--run-dir", str(self.run_dir), "--insecure"]
        self.proxies = {}
        for name in settings.sites:
            slow = name == SLOW_SITE and bool(faults) and settings.slow_link and not settings.smoke
            mbps = slow_link_mbps(settings, self.cfg) if slow else 0.0
            link = LinkConfig(latency_ms=settings.latency_ms, bandwidth_mbps=mbps)
            self.proxies[name] = ProxyThread(self.target, link, control_port=0)
        self.links = {name: proxy.control_address for name, proxy in self.proxies.items()}
        self.commits: dict[int, float] = {}  # round -> when its commit was first seen
        self.restarts = dict.fromkeys([*settings.sites, "coordinator"], 0)
        self.coordinator_deaths: list[dict[str, float]] = []

    def env_faults(self) -> None:
        if self.faults:
            os.environ[FAULT_PLAN_ENV] = str(self.plan)
        else:
            os.environ.pop(FAULT_PLAN_ENV, None)

    def start_coordinator(self) -> subprocess.Popen[bytes]:
        proc = spawn_geodiloco(self.serve_args, self.workdir / "coordinator.log")
        if self.faults:  # its pid for the sites' coordinator kills, rewritten at every restart
            tmp = self.plan.with_suffix(".tmp")
            FaultPlan(faults=self.faults, links=self.links, coordinator_pid=proc.pid).write(tmp)
            tmp.replace(self.plan)
        return proc

    def start_site(self, name: str) -> subprocess.Popen[bytes]:
        args = ["site", "run", "--name", name, "--coordinator", self.proxies[name].address]
        return spawn_geodiloco([*args, "--nproc", "1", "--insecure"], self.workdir / f"{name}.log")

    def poll_rounds(self) -> None:
        path = self.run_dir / "rounds.jsonl"
        if not path.exists():
            return
        now = time.monotonic()
        for line in path.read_text().split("\n")[:-1]:
            self.commits.setdefault(json.loads(line)["round"], now)

    def serving(self) -> bool:
        try:
            fetch_status(self.target, None, timeout_s=0.5)
        except Exception:  # any failure: not serving yet
            return False
        return True

    def run(self) -> dict[str, Any]:
        self.env_faults()
        self.started = time.monotonic()
        coordinator = self.start_coordinator()
        sites = {name: self.start_site(name) for name in self.s.sites}
        death: dict[str, float] | None = None
        try:
            deadline = time.monotonic() + self.s.timeout_s
            while any(proc.poll() != 0 for proc in sites.values()):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the run did not finish in {self.s.timeout_s:.0f}s; see {self.workdir}"
                    )
                self.poll_rounds()
                now = time.monotonic()
                if coordinator.poll() is not None:
                    coordinator = self.start_coordinator()
                    self.restarts["coordinator"] += 1
                    death = {"restarted": now, "last_round": max(self.commits, default=-1)}
                if death is not None:
                    if "serving_s" not in death and self.serving():
                        death["serving_s"] = time.monotonic() - death["restarted"]
                    if max(self.commits, default=-1) > death["last_round"]:
                        death["commit_s"] = now - death["restarted"]
                        self.coordinator_deaths.append(
                            {
                                "restart_to_serving_s": death.get("serving_s", math.nan),
                                "restart_to_next_commit_s": death["commit_s"],
                            }
                        )
                        death = None
                for name, proc in sites.items():
                    if proc.poll() not in (None, 0):
                        sites[name] = self.start_site(name)
                        self.restarts[name] += 1
                time.sleep(POLL_S)
            self.poll_rounds()
            status = self.status = fetch_status(self.target, None)
            request_shutdown(self.target, None)
            coordinator.wait(timeout=60)
        finally:
            for proc in (*sites.values(), coordinator):
                if proc.poll() is None:
                    kill_tree(proc)
            for proxy in self.proxies.values():
                proxy.close()
        return self.figures(status)

    def figures(self, status: Any) -> dict[str, Any]:
        path = self.run_dir / "rounds.jsonl"
        log = [json.loads(line) for line in path.read_text().split("\n")[:-1]]
        committed = sorted({r["round"] for r in log})
        chain_breaks = sum(1 for a, b in itertools.pairwise(log) if b["base_hash"] != a["state_hash"])
        records = [
            ConsumedRecord(e["round"], site, DataRange(shard, start, end, epoch))
            for e in log
            for site, shard, start, end, epoch in e["data"]
        ]
        problems = check_exactly_once(records, data_shard_sizes(self.cfg))
        return {
            "rounds": self.cfg.rounds,
            "rounds_committed": len(committed),
            "rounds_lost": len(set(range(self.cfg.rounds)) - set(committed)),
            "rounds_repeated": len(log) - len(committed),
            "hash_mismatches": sum(1 for s in status.sites if not s.hash_ok) + chain_breaks,
            "ledger_audit": "clean" if not problems else "; ".join(problems[:5]),
            "final_eval_loss": status.history[-1].eval_loss if status.history else math.nan,
            "wall_s": time.monotonic() - self.started,
            "restarts": self.restarts,
            "faults": self.fault_stalls(),
            "typical_round_s": self.typical_round_s(),
            "coordinator_restarts": self.coordinator_deaths,
        }

    def fault_stalls(self) -> list[dict[str, Any]]:
        """Per fault: the longest wait for a commit while it was the latest fault to fire.

        Its window runs from its firing to the next fault's; a wait that the next fault's
        firing interrupts is counted up to that moment (what follows is the next fault's)."""
        if not self.faults:
            return []
        records = fired(self.plan)
        now_wall, now_mono = time.time(), time.monotonic()
        fired_at = {i: now_mono - (now_wall - r["time"]) for i, r in records.items()}
        order = sorted(fired_at, key=lambda i: fired_at[i])
        commits = sorted(self.commits.values())
        out = []
        for i, fault in enumerate(self.faults):
            entry: dict[str, Any] = {
                "fault": {k: v for k, v in asdict(fault).items() if v not in ("", 0, 0.0)}
            }
            if i not in fired_at:
                out.append({**entry, "fired": False})
                continue
            start = fired_at[i]
            later = [fired_at[j] for j in order if fired_at[j] > start]
            within = [t for t in commits if start < t]
            if later:
                within = [t for t in within if t <= later[0]] + [later[0]]
            times = [start, *within]
            entry.update(
                fired=True,
                fired_round=records[i]["round"],
                fired_at=records[i]["step"],
                longest_stall_s=round(max((b - a for a, b in itertools.pairwise(times)), default=0.0), 2),
            )
            out.append(entry)
        return out

    def typical_round_s(self) -> float:
        """The median gap between commits: a round's pace in this run when nothing fails."""
        gaps = sorted(b - a for a, b in itertools.pairwise(sorted(self.commits.values())))
        return gaps[len(gaps) // 2] if gaps else math.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--rounds", type=int, default=60, help="rounds of each run (default 60)")
    parser.add_argument("--keep", type=Path, help="keep the processes' logs in this directory")
    parser.add_argument("--smoke", action="store_true", help="8 rounds, two faults")
    args = parser.parse_args()
    settings = Settings(rounds=8 if args.smoke else args.rounds, smoke=args.smoke)
    cfg = settings.run_config()
    with tempfile.TemporaryDirectory(prefix="geodiloco-chaos-") as scratch:
        root = args.keep or Path(scratch)
        (root / "calm").mkdir(parents=True, exist_ok=True)
        (root / "chaos").mkdir(parents=True, exist_ok=True)
        calm = Soak(settings, root / "calm", []).run()
        chaos = Soak(settings, root / "chaos", settings.faults()).run()
    loss, calm_loss = chaos["final_eval_loss"], calm["final_eval_loss"]
    stalls = [f["longest_stall_s"] for f in chaos["faults"] if f.get("fired")]
    results = {
        "settings": {**asdict(settings), "sites": len(SITES), "lease_s": settings.lease_s},
        "num_params": state_bytes(cfg) // 4,
        "slow_link_mbps": slow_link_mbps(settings, cfg),
        **{k: chaos[k] for k in ("rounds", "rounds_committed", "rounds_lost", "rounds_repeated")},
        **{k: chaos[k] for k in ("hash_mismatches", "ledger_audit", "restarts", "faults")},
        "longest_stall_s": max(stalls, default=0.0),
        # a stall includes the round's own time (the slow site's transfers make it seconds):
        # what a fault added is the stall less a typical round of this run
        "typical_round_s": round(chaos["typical_round_s"], 2),
        "longest_stall_over_round_s": round(max(stalls, default=0.0) - chaos["typical_round_s"], 2),
        "coordinator_restarts": chaos["coordinator_restarts"],
        "final_eval_loss": loss,
        "fault_free_eval_loss": calm_loss,
        "eval_loss_ratio": loss / calm_loss if calm_loss else math.nan,
        "chaos_wall_s": chaos["wall_s"],
        "fault_free_wall_s": calm["wall_s"],
        "fault_free_rounds_lost": calm["rounds_lost"],
    }
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    sys.exit(0)


if __name__ == "__main__":
    main()
