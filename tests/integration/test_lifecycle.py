"""Graceful stop of a site: SIGTERM to `geodiloco site run` (as systemd, Docker and Kubernetes
send it) makes its torchrun ranks stop together at a step boundary and Leave the run."""

from __future__ import annotations

import json
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
    # a long run of site-a alone, so it is mid-run when stopped
    cfg = tiny_config(rounds=10_000, sites=["site-a"], lease_s=600.0)
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


def test_sigterm_checkpoints_mid_round_and_the_site_resumes_there(tmp_path: Path) -> None:
    # site-a alone carries the run; while it is away the round stays open
    cfg = tiny_config(
        rounds=10_000, sites=["site-a"], lease_s=600.0, inner__steps_per_round=40, inner__lr=5e-4
    )
    ckpt = tmp_path / "ckpt"
    with CoordinatorThread(cfg) as coordinator:
        base = ["site", "run", "--name", "site-a", "--coordinator", coordinator.target, "--insecure"]
        first = spawn_geodiloco([*base, "--nproc", "2", "--checkpoint-dir", str(ckpt)], tmp_path / "a.log")
        try:
            deadline = time.monotonic() + 240
            while coordinator.controller.round < 1:  # one round committed, the next under way
                assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "a.log").read_text()[
                    -3000:
                ]
                time.sleep(0.2)
            time.sleep(1.0)
            first.send_signal(signal.SIGTERM)
            assert first.wait(timeout=120) == 0, (tmp_path / "a.log").read_text()[-3000:]
        finally:
            if first.poll() is None:
                first.kill()
        saved = sorted(ckpt.glob("round-*/site.json"))
        assert len(saved) == 1, (tmp_path / "a.log").read_text()[-3000:]
        meta = json.loads(saved[0].read_text())
        at_round = coordinator.controller.round
        assert meta["round"] == at_round and meta["ranks"] == 2

        again = spawn_geodiloco(
            [*base, "--nproc", "2", "--layout", "fsdp", "--checkpoint-dir", str(ckpt)], tmp_path / "a2.log"
        )
        try:
            deadline = time.monotonic() + 240
            while coordinator.controller.round <= at_round:  # it finishes the round it left
                assert again.poll() is None and time.monotonic() < deadline, (
                    tmp_path / "a2.log"
                ).read_text()[-3000:]
                time.sleep(0.2)
            again.send_signal(signal.SIGTERM)
            assert again.wait(timeout=120) == 0
        finally:
            if again.poll() is None:
                again.kill()
        resumed = json.loads((ckpt / "resumed.json").read_text())
        text = (tmp_path / "a2.log").read_text()
    for key in ("state_hash", "params_hash", "residual_hash"):
        assert resumed[key] == meta[key], key
    assert f"step {meta['steps_in_round']}, 2 ranks before" in text
    assert "behind the run" not in text  # it continued mid-round, not from the global state
    record = coordinator.controller.history[at_round]
    assert record.contributors == ["site-a"] and record.hashes_agree
