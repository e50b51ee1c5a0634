"""Graceful stop of a site: SIGTERM to `geodiloco site run` (as systemd, Docker and Kubernetes
send it) makes its torchrun ranks stop together at a step boundary and Leave the run."""

from __future__ import annotations

import signal
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from geodiloco.status import fetch_status
from helpers import CoordinatorThread, free_port, spawn_geodiloco, tiny_config

pytestmark = pytest.mark.integration


def _rounds_done(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "geodiloco_site_rounds_total":
                return sample.value
    return 0.0


def test_sigterm_makes_a_site_leave_instead_of_timing_out(tmp_path: Path) -> None:
    # a long run that site-a alone may carry (min_sites=1), so it is mid-run when stopped
    cfg = tiny_config(rounds=10_000, min_sites=1, lease_s=600.0)
    metrics_port = free_port()
    with CoordinatorThread(cfg) as coordinator:
        log = tmp_path / "site-a.log"
        site = spawn_geodiloco(
            [
                *("site", "run", "--name", "site-a", "--coordinator", coordinator.target),
                *("--nproc", "2", "--insecure", "--metrics-port", str(metrics_port)),
            ],
            log,
        )
        try:
            deadline = time.monotonic() + 240
            while True:
                try:
                    if _rounds_done(metrics_port) >= 2:
                        break
                except OSError:
                    pass  # not serving yet
                assert site.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            site.send_signal(signal.SIGTERM)
            rc = site.wait(timeout=120)
        finally:
            if site.poll() is None:
                site.kill()
        status = fetch_status(coordinator.target, None)
        text = log.read_text()
    record = next(s for s in status.sites if s.site == "site-a")
    # it left (a lease of 600 s cannot have lapsed): the Leave RPC reached the coordinator
    assert record.state == "left", text[-3000:]
    assert not status.finished and status.round >= 2
    # every contribution it made was committed: no half-pushed round was left behind
    assert record.accepted == status.round and record.rejected == 0 and record.hash_ok
    assert "SIGTERM: the ranks leave after the current step" in text and "stop requested" in text
    assert rc == 0, text[-3000:]
