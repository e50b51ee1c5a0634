"""How fast a run recovers, measured on the real system: a coordinator process and site processes
(torchrun, gloo) on loopback, each site behind its own ``geodiloco.app.wan`` proxy.

Prints, measured (not modelled):
  1. site death: seconds from SIGKILL of a site's process group to the next round committed
     without it (bounded by the lease, ``lease_s``, or the round deadline, whichever ends first);
  2. rejoin: seconds from restarting that site to the first round committed with it again
     (process start, torch import and the full-state pull included);
  3. coordinator death: seconds from SIGKILL of the coordinator to the first round committed by
     its restarted process (it resumes from its durable state; sites reconnect and re-push);
  4. catch-up: seconds for a rejoining site to bring itself to the current round (join, then
     pull and decode the full state, or the kept updates of the rounds it missed) through a
     link of each emulated bandwidth, against the bytes moved and their ideal transfer time.

    python benchmarks/recovery.py [--json PATH] [--repeats N] [--bandwidths 2,10,50] [--keep DIR] [--smoke]

``--smoke`` (2 sites, quorum 1, one kill of each kind, one bandwidth) only checks that the
benchmark still runs; it takes about a minute, most of it process start-up.

Commit times are observed by polling the coordinator's round log every 20 ms, so every figure
carries up to ~20 ms of observation delay. The default run takes a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geodiloco.app.status import fetch_status, request_shutdown
from geodiloco.app.wan import LinkConfig, ProxyThread
from geodiloco.config import RunConfig
from geodiloco.site.edge.client import OuterSyncClient
from geodiloco.site.outer_sync import CATCH_UP_ROUNDS
from geodiloco.testing.processes import kill_tree, spawn_geodiloco

POLL_S = 0.02
WAIT_S = 240.0


@dataclass(kw_only=True, slots=True)
class Settings:
    """The run the figures are measured on (small, so that it fits a shared 2-core machine)."""

    sites: int = 3
    nproc: int = 1
    d_model: int = 64
    n_layer: int = 2
    steps_per_round: int = 10
    min_sites: int = 2  # a quorum the survivors can reach; 0 (all sites) would wait forever
    lease_s: float = 3.0
    heartbeat_interval_s: float = 0.5
    round_timeout_s: float = 6.0
    latency_ms: float = 20.0
    site_bandwidth_mbps: float = 50.0
    bandwidths_mbps: tuple[float, ...] = (2.0, 10.0, 50.0)
    repeats: int = 2

    def run_config(self) -> RunConfig:
        return RunConfig.from_dict(
            {
                "run_id": "recovery-bench",
                "sites": [f"site-{i + 1}" for i in range(self.sites)],
                "rounds": 100_000,  # never reached: the benchmark stops the run when it is done
                "min_sites": self.min_sites,
                "lease_s": self.lease_s,
                "heartbeat_interval_s": self.heartbeat_interval_s,
                "round_timeout_s": self.round_timeout_s,
                "model": {"n_layer": self.n_layer, "n_head": 2, "d_model": self.d_model, "seq_len": 32},
                "data": {"max_bytes": 300_000, "batch_size": 4, "eval_sequences": 16},
                "inner": {"steps_per_round": self.steps_per_round, "lr": 3e-3},
                "outer": {"optimizer": "nesterov", "lr": 0.7, "momentum": 0.5},
            }
        )


class Run:
    """A coordinator and its sites as real processes, each site behind a WAN proxy."""

    def __init__(self, settings: Settings, workdir: Path) -> None:
        self.s = settings
        self.cfg = settings.run_config()
        self.workdir = workdir
        self.run_dir = workdir / "coord"
        self.port_file = workdir / "port"
        config = workdir / "run.json"
        config.write_text(self.cfg.to_json())
        self.target = f"127.0.0.1:{free_port()}"
        self.serve_args = [
            "coordinator",
            "serve",
            "--config",
            str(config),
            "--port",
            self.target.rpartition(":")[2],
            "--port-file",
            str(self.port_file),
            "--run-dir",
            str(self.run_dir),
            "--insecure",
        ]
        self.coordinator = self.start_coordinator()
        link = LinkConfig(latency_ms=settings.latency_ms, bandwidth_mbps=settings.site_bandwidth_mbps)
        self.proxies = {name: ProxyThread(self.target, link) for name in self.cfg.sites}
        self.sites = {name: self.start_site(name) for name in self.cfg.sites}

    def start_coordinator(self) -> subprocess.Popen[bytes]:
        self.port_file.unlink(missing_ok=True)
        return spawn_geodiloco(self.serve_args, self.workdir / "coordinator.log")

    def start_site(self, name: str) -> subprocess.Popen[bytes]:
        args = ["site", "run", "--name", name, "--coordinator", self.proxies[name].address]
        return spawn_geodiloco(
            [*args, "--nproc", str(self.s.nproc), "--insecure"], self.workdir / f"{name}.log"
        )

    def rounds(self) -> list[dict[str, Any]]:
        """The committed rounds logged so far; a line still being written is not one yet."""
        path = self.run_dir / "rounds.jsonl"
        complete = path.read_text().split("\n")[:-1] if path.exists() else []
        return [json.loads(line) for line in complete]

    def wait_for(self, condition: Callable[[], bool], what: str) -> float:
        """Poll until ``condition``; the time it became true. Says what the run was doing if not."""
        deadline = time.monotonic() + WAIT_S
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}; {self.describe()}")
            for name, proc in (("coordinator", self.coordinator), *self.sites.items()):
                if proc.poll() not in (None, -signal.SIGKILL):
                    log = (self.workdir / f"{name}.log").read_text()[-2000:]
                    raise RuntimeError(f"{name} exited with {proc.returncode} waiting for {what}:\n{log}")
            time.sleep(POLL_S)
        return time.monotonic()

    def wait_for_commit(self, after: int, condition: Callable[[dict[str, Any]], bool], what: str) -> float:
        """The time a round numbered >= ``after`` that satisfies ``condition`` appeared in the log."""
        return self.wait_for(lambda: any(r["round"] >= after and condition(r) for r in self.rounds()), what)

    def describe(self) -> str:
        try:
            st = fetch_status(self.target, None, timeout_s=5)
        except Exception as exc:  # a diagnostic only: say why it is missing
            return f"status unavailable ({exc.__class__.__name__})"
        sites = ", ".join(f"{s.site}:{s.state}/r{s.last_round}" for s in st.sites)
        return f"coordinator at round {st.round}, phase {st.phase}, sites {sites}"

    def close(self) -> None:
        if self.coordinator.poll() is None:
            try:
                request_shutdown(self.target, None, grace_s=0.5)
                self.coordinator.wait(timeout=20)
            except Exception:  # best effort; SIGKILL below
                pass
        for proc in (*self.sites.values(), self.coordinator):
            if proc.poll() is None:
                kill_tree(proc)
        for proxy in self.proxies.values():
            proxy.close()


def free_port() -> int:
    """A free loopback port; the coordinator binds it for good (restarts reuse it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def round_intervals(rounds: list[dict[str, Any]]) -> float:
    """The median of the coordinator's own round durations (first arrival to commit excluded)."""
    return statistics.median(r["duration_s"] for r in rounds) if rounds else float("nan")


def measure_site_death(run: Run, victim: str) -> dict[str, float]:
    start = len(run.rounds())
    run.wait_for(lambda: len(run.rounds()) > start, "a commit before the kill")
    killed_at_round = len(run.rounds())
    killed = time.monotonic()
    kill_tree(run.sites[victim])
    committed = run.wait_for_commit(
        killed_at_round, lambda r: victim not in r["contributors"], "a round without it"
    )
    restarted = time.monotonic()
    run.sites[victim] = run.start_site(victim)
    after = len(run.rounds())
    rejoined = run.wait_for_commit(
        after, lambda r: victim in r["contributors"], f"{victim} contributing again"
    )
    return {"death_to_commit_s": committed - killed, "restart_to_contribution_s": rejoined - restarted}


def measure_coordinator_death(run: Run, typical_round_s: float) -> dict[str, float]:
    start = len(run.rounds())
    run.wait_for(lambda: len(run.rounds()) > start, "a commit before the kill")
    time.sleep(typical_round_s / 2)  # mid-round: sites are training or pushing
    committed_before = len(run.rounds())
    killed = time.monotonic()
    run.coordinator.send_signal(signal.SIGKILL)
    run.coordinator.wait()
    run.coordinator = run.start_coordinator()
    serving = run.wait_for(run.port_file.exists, "the restarted coordinator to serve")
    # Rounds committed before the kill are in the durable state; only a newer round counts.
    durable = max(committed_before, len(run.rounds()))
    committed = run.wait_for(lambda: len(run.rounds()) > durable, "a commit after the restart")
    return {"kill_to_serving_s": serving - killed, "kill_to_commit_s": committed - killed}


def measure_catch_up(run: Run, victim: str, bandwidth_mbps: float) -> dict[str, float]:
    """A rejoining site (the victim's identity, its process stopped) brings itself to the current
    round: join, then either the full state or the kept updates of the last rounds it missed."""
    link = LinkConfig(latency_ms=run.s.latency_ms, bandwidth_mbps=bandwidth_mbps)
    with ProxyThread(run.target, link) as proxy:
        client = OuterSyncClient(proxy.address, victim)
        try:
            started = time.monotonic()
            info = client.join(world_size=run.s.nproc)
            joined = time.monotonic()
            join_bytes = client.bytes_received
            missed = range(info.round - CATCH_UP_ROUNDS, info.round)  # first, while still kept
            updates = [client.pull_tensor(r, info.num_params, timeout_s=120) for r in missed]
            pulled_updates = time.monotonic()
            update_bytes = client.bytes_received - join_bytes
            full = client.pull_tensor(info.round, info.num_params, full_state=True, timeout_s=120)
            pulled_full = time.monotonic()
            full_bytes = client.bytes_received - join_bytes - update_bytes
            client.leave("benchmark: catch-up measured")
        finally:
            client.close()
    assert full.is_full_state and not any(u.is_full_state for u in updates), "updates no longer kept"
    join_s = joined - started
    return {
        "bandwidth_mbps": bandwidth_mbps,
        "state_bytes": info.num_params * 4,
        "join_s": join_s,
        "full_state_bytes": full_bytes,
        "full_state_ideal_s": full_bytes * 8 / (bandwidth_mbps * 1e6),
        "full_state_s": join_s + pulled_full - pulled_updates,
        "missed_rounds": CATCH_UP_ROUNDS,
        "updates_bytes": update_bytes,
        "updates_ideal_s": update_bytes * 8 / (bandwidth_mbps * 1e6),
        "updates_s": join_s + pulled_updates - joined,
    }


def note(text: str) -> None:
    """Progress on stderr, so that a long run shows where it is."""
    print(f"[recovery] {text}", file=sys.stderr, flush=True)


def run_benchmark(s: Settings, workdir: Path) -> dict[str, Any]:
    run = Run(s, workdir)
    victim = run.cfg.sites[-1]
    results: dict[str, Any] = {"settings": dataclasses.asdict(s)}
    try:
        first = time.monotonic()
        run.wait_for(lambda: len(run.rounds()) >= 3, "3 rounds")  # warm-up: every site trains
        results["startup_to_round_3_s"] = time.monotonic() - first
        typical = round_intervals(run.rounds()[1:])
        results["typical_round_s"] = typical
        note(f"warm: 3 rounds in {results['startup_to_round_3_s']:.1f}s; killing sites")
        results["site_death"] = [measure_site_death(run, victim) for _ in range(s.repeats)]
        note("killing the coordinator")
        results["coordinator_death"] = [measure_coordinator_death(run, typical) for _ in range(s.repeats)]
        kill_tree(run.sites[victim])  # its identity is used by the catch-up client below
        # A restarted coordinator keeps only the updates it committed itself: let a few commit.
        resumed = len(run.rounds())
        run.wait_for(lambda: len(run.rounds()) > resumed + CATCH_UP_ROUNDS, "rounds after the restart")
        note("measuring catch-up")
        results["catch_up"] = [measure_catch_up(run, victim, bw) for bw in s.bandwidths_mbps]
        results["rounds_committed"] = len(run.rounds())
        results["num_params"] = results["catch_up"][0]["state_bytes"] // 4
    finally:
        run.close()
    return results


def print_report(r: dict[str, Any]) -> None:
    s = r["settings"]
    print(
        f"{s['sites']} sites x {s['nproc']} rank, {r.get('num_params', 0):,} parameters, "
        f"H={s['steps_per_round']}, "
        f"quorum {s['min_sites']}, lease {s['lease_s']}s, deadline {s['round_timeout_s']}s, "
        f"links {s['latency_ms']} ms / {s['site_bandwidth_mbps']} Mbit/s"
    )
    print(f"typical round (first push to commit): {r['typical_round_s']:.2f} s")
    for i, m in enumerate(r["site_death"]):
        print(
            f"site death #{i + 1}: SIGKILL -> round committed without it {m['death_to_commit_s']:6.2f} s; "
            f"restart -> contributing again {m['restart_to_contribution_s']:6.2f} s"
        )
    for i, m in enumerate(r["coordinator_death"]):
        print(
            f"coordinator death #{i + 1}: SIGKILL -> serving again {m['kill_to_serving_s']:6.2f} s, "
            f"-> first round committed {m['kill_to_commit_s']:6.2f} s"
        )
    print(
        f"catch-up of a rejoining site (join, then pull and decode the full state, or the "
        f"{r['catch_up'][0]['missed_rounds']} kept updates it missed; bytes without the join's):"
    )
    print(
        f"{'Mbit/s':>7} {'state bytes':>12} | {'full bytes':>10} {'ideal s':>8} {'measured s':>10} | "
        f"{'upd. bytes':>10} {'ideal s':>8} {'measured s':>10}"
    )
    for m in r["catch_up"]:
        print(
            f"{m['bandwidth_mbps']:7.1f} {m['state_bytes']:12,} | {m['full_state_bytes']:10,} "
            f"{m['full_state_ideal_s']:8.2f} {m['full_state_s']:10.2f} | {m['updates_bytes']:10,} "
            f"{m['updates_ideal_s']:8.2f} {m['updates_s']:10.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--repeats", type=int, default=2, help="site and coordinator kills (default 2)")
    parser.add_argument(
        "--bandwidths", default="2,10,50", help="catch-up link bandwidths, Mbit/s, comma-separated"
    )
    parser.add_argument("--keep", type=Path, help="keep the processes' logs in this directory")
    parser.add_argument("--smoke", action="store_true", help="2 sites, one kill of each kind, one bandwidth")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    try:
        bandwidths = tuple(float(b) for b in args.bandwidths.split(","))
    except ValueError:
        parser.error(f"--bandwidths: expected numbers like 2,10,50, got {args.bandwidths!r}")
    if any(b <= 0 for b in bandwidths):
        parser.error("--bandwidths must be > 0")
    settings = Settings(repeats=args.repeats, bandwidths_mbps=bandwidths)
    if args.smoke:
        settings = Settings(sites=2, min_sites=1, repeats=1, bandwidths_mbps=(50.0,))
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        results = run_benchmark(settings, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="geodiloco-recovery-") as tmp:
            results = run_benchmark(settings, Path(tmp))
    print_report(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
