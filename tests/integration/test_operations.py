"""Operations on a real run: metrics scraped from the live processes, a graceful coordinator
stop seen through its health service, and `geodiloco report` on the finished run directory.

One run (a coordinator process and two `geodiloco site run` processes, over loopback) is shared
by the tests of this module; each test asserts on what it recorded.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from geodiloco.app.status import fetch_status
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.processes import spawn_geodiloco
from geodiloco.testing.servers import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROUNDS = 4
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def wait_for(
    predicate: Any, what: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 240
) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            result = predicate()
        except (OSError, KeyError):
            result = None
        if result:
            return result
        if proc.poll() is not None:
            raise AssertionError(f"exited while waiting for {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")


@dataclass
class RunRecord:
    workdir: Path
    steps_per_round: int
    num_params: int
    blocked_site: Samples = field(default_factory=dict)  # site-a while round 0 waits for site-b
    coordinator: Samples = field(default_factory=dict)  # after both sites left
    status: Any = None
    health: list[str] = field(default_factory=list)  # health Watch updates around SIGTERM
    coordinator_rc: int | None = None
    coordinator_log: str = ""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunRecord]:
    workdir = tmp_path_factory.mktemp("ops")
    cfg = tiny_config(rounds=ROUNDS, min_sites=2)  # both sites contribute to every round
    (workdir / "run.json").write_text(cfg.to_json())
    ports = {name: free_port() for name in ("grpc", "metrics", "health", "site-a", "site-b")}
    coordinator = spawn_geodiloco(
        [
            "coordinator",
            "serve",
            "--config",
            str(workdir / "run.json"),
            "--port",
            str(ports["grpc"]),
            "--metrics-port",
            str(ports["metrics"]),
            "--health-port",
            str(ports["health"]),
            "--run-dir",
            str(workdir / "coord"),
            "--insecure",
        ],
        workdir / "coordinator.log",
    )
    target = f"127.0.0.1:{ports['grpc']}"
    from geodiloco.coordinator.edge.server import initial_parameters

    record = RunRecord(workdir, cfg.inner.steps_per_round, initial_parameters(cfg).numel())
    sites: dict[str, subprocess.Popen[bytes]] = {}

    def start_site(name: str) -> None:
        sites[name] = spawn_geodiloco(
            [
                *("site", "run", "--name", name, "--coordinator", target, "--nproc", "1", "--insecure"),
                *("--metrics-port", str(ports[name]), "--log-format", "json"),
            ],
            workdir / f"{name}.log",
        )

    try:
        # site-a alone: it trains round 0, pushes, then waits, because round 0 needs site-b too
        start_site("site-a")
        steps = "geodiloco_site_inner_step_seconds_count"
        record.blocked_site = wait_for(
            lambda: (
                (s := scrape(ports["site-a"]))
                and value(s, steps, site="site-a") == cfg.inner.steps_per_round
                and value(s, "geodiloco_site_wan_bytes_total", site="site-a", direction="up")
                > record.num_params
                and s
            ),
            "site-a to finish round 0's inner steps and push",
            sites["site-a"],
            workdir / "site-a.log",
        )
        start_site("site-b")
        for name, proc in sites.items():
            assert proc.wait(timeout=300) == 0, (workdir / f"{name}.log").read_text()[-3000:]
        record.status = fetch_status(target, None)
        record.coordinator = scrape(ports["metrics"])
        record.health, record.coordinator_rc = _sigterm_watching_health(coordinator, ports["health"])
        record.coordinator_log = (workdir / "coordinator.log").read_text()
        yield record
    finally:
        for proc in (*sites.values(), coordinator):
            if proc.poll() is None:
                proc.kill()


def _sigterm_watching_health(coordinator: subprocess.Popen[bytes], port: int) -> tuple[list[str], int]:
    """SIGTERM the coordinator while a health Watch stream is open; the statuses it saw."""
    seen: list[str] = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stream = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=60
        )
        seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(next(stream).status))
        coordinator.send_signal(signal.SIGTERM)
        try:
            for update in stream:
                seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(update.status))
        except grpc.RpcError:
            pass  # the server went away after the NOT_SERVING update
    return seen, coordinator.wait(timeout=60)


def test_metrics_of_a_site_blocked_in_round_zero(run: RunRecord) -> None:
    s = run.blocked_site
    assert value(s, "geodiloco_site_rounds_total", site="site-a") == 0
    assert value(s, "geodiloco_site_round", site="site-a") == 0
    assert value(s, "geodiloco_site_inner_step_seconds_count", site="site-a") == run.steps_per_round
    assert value(s, "geodiloco_site_inner_step_seconds_sum", site="site-a") > 0
    # one int8 pseudo-gradient has gone up (about a byte per parameter); the full state did not
    # come down, because site-a built the same round-0 parameters itself
    up = value(s, "geodiloco_site_wan_bytes_total", site="site-a", direction="up")
    assert run.num_params < up < 1.2 * run.num_params
    assert value(s, "geodiloco_site_wan_bytes_total", site="site-a", direction="down") < run.num_params
    site_a = next(x for x in run.status.sites if x.site == "site-a")
    assert up <= site_a.bytes_in  # the coordinator received at least what the site had sent then


def test_coordinator_metrics_agree_with_the_run(run: RunRecord) -> None:
    s, status = run.coordinator, run.status
    assert status.finished and status.round == ROUNDS
    assert value(s, "geodiloco_rounds_committed_total") == ROUNDS == len(status.history)
    assert value(s, "geodiloco_round") == ROUNDS
    assert value(s, "geodiloco_tokens_total") == sum(h.tokens for h in status.history)
    assert value(s, "geodiloco_round_duration_seconds_count") == ROUNDS
    assert value(s, "geodiloco_round_duration_seconds_sum") == pytest.approx(
        sum(h.duration_s for h in status.history)
    )
    assert value(s, "geodiloco_round_duration_seconds_bucket", le="+Inf") == ROUNDS
    total = 0.0
    for site in status.sites:
        up = value(s, "geodiloco_wan_bytes_total", site=site.site, direction="up")
        down = value(s, "geodiloco_wan_bytes_total", site=site.site, direction="down")
        assert (up, down) == (site.bytes_in, site.bytes_out)
        total += up + down
        assert (
            value(s, "geodiloco_contributions_total", site=site.site, outcome="accepted", reason="") == ROUNDS
        )
        assert value(s, "geodiloco_site_up", site=site.site) == 0  # both left
        assert value(s, "geodiloco_reported_train_loss", site=site.site) == pytest.approx(site.train_loss)
        assert value(s, "geodiloco_uplink_compression_ratio", site=site.site) > 3.5  # q8|zstd: ~4x
    # the number the demo's summary reports as diloco.wan_bytes
    assert total == status.wan_bytes_in + status.wan_bytes_out
    assert value(s, "geodiloco_eval_loss") == pytest.approx(status.history[-1].eval_loss)
    assert value(s, "geodiloco_downlink_compression_ratio") > 3.5
    assert not any(name == "geodiloco_lease_expiries_total" for name, _ in s)  # no site was ever lost
    assert not any(
        name == "geodiloco_contributions_total" and ("outcome", "rejected") in lb for name, lb in s
    )


def test_sigterm_flips_health_then_stops_the_coordinator(run: RunRecord) -> None:
    assert run.health[:2] == ["SERVING", "NOT_SERVING"]
    assert run.coordinator_rc == 0
    assert f"stopping: {ROUNDS} rounds committed and durable" in run.coordinator_log


def test_site_logs_are_json_lines_with_run_round_site_and_rank(run: RunRecord) -> None:
    lines = [
        json.loads(line)
        for line in (run.workdir / "site-a.log").read_text().splitlines()
        if line.startswith("{")
    ]
    done = [x for x in lines if x["message"].startswith("round ") and " done:" in x["message"]]
    assert len(done) == ROUNDS
    for entry in done:
        assert entry["run"] == "test-run" and entry["site"] == "site-a" and entry["rank"] == 0
        assert entry["round"] == int(entry["message"].split()[1]) + 1  # logged after the round closed


def test_report_draws_the_finished_run(run: RunRecord) -> None:
    out = run.workdir / "report"
    result = subprocess.run(
        [sys.executable, "-m", "geodiloco", "report", str(run.workdir / "coord"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    expected = {
        "eval_loss.png": ["site-a", "site-b", "global"],
        "bytes_per_round.png": ["up", "down"],
        "timeline.png": ["compute", "transfer", "waiting"],
    }
    for name, series in expected.items():
        path = out / name
        assert path.stat().st_size > 10_000, name
        with Image.open(path) as image:
            assert image.size == (900, 500)
            assert json.loads(image.text["Series"]) == series
            assert len(image.convert("L").getcolors(maxcolors=256) or []) > 8  # not a blank canvas
    markdown = (out / "report.md").read_text()
    for name in expected:
        assert f"]({name})" in markdown
    assert f"rounds committed: **{ROUNDS}**" in markdown
    assert "| site-a | 4 |" in markdown and "| site-b | 4 |" in markdown
    assert f"{run.status.history[-1].eval_loss:.4f}" in markdown  # the final global eval loss
