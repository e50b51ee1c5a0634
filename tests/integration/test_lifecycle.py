"""Graceful stop of a site: SIGTERM to `geodiloco site run` (as systemd, Docker and Kubernetes
send it) makes its torchrun ranks stop together at a step boundary, checkpoint mid-round and
Leave the run; restarted with another layout, the site resumes at that step."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from geodiloco.app.status import fetch_status
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.processes import spawn_geodiloco
from geodiloco.testing.servers import CoordinatorThread, free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _rounds_done(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "geodiloco_site_rounds_total":
                return sample.value
    return 0.0


def test_sigterm_leaves_with_a_mid_round_checkpoint_and_the_site_resumes_there(tmp_path: Path) -> None:
    # site-a alone carries the run (a long one, so it is mid-run when stopped); while it is
    # away the round stays open, and a lease of 600 s cannot lapse
    cfg = tiny_config(
        rounds=10_000, sites=["site-a"], lease_s=600.0, inner__steps_per_round=40, inner__lr=5e-4
    )
    ckpt = tmp_path / "ckpt"
    metrics_port = free_port()
    with CoordinatorThread(cfg) as coordinator:
        base = ["site", "run", "--name", "site-a", "--coordinator", coordinator.target, "--insecure"]
        first = spawn_geodiloco(
            [*base, "--nproc", "2", "--checkpoint-dir", str(ckpt), "--metrics-port", str(metrics_port)],
            tmp_path / "a.log",
        )
        try:
            deadline = time.monotonic() + 240
            while True:  # one round committed (as the site's metrics count it), the next under way
                try:
                    if _rounds_done(metrics_port) >= 1:
                        break
                except OSError:
                    pass  # not serving yet
                assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "a.log").read_text()[
                    -3000:
                ]
                time.sleep(0.2)
            time.sleep(1.0)
            first.send_signal(signal.SIGTERM)
            rc = first.wait(timeout=120)
        finally:
            if first.poll() is None:
                first.kill()
        text = (tmp_path / "a.log").read_text()
        assert rc == 0, text[-3000:]
        status = fetch_status(coordinator.target, None)
        record = next(s for s in status.sites if s.site == "site-a")
        # it left (the lease cannot have lapsed): the Leave RPC reached the coordinator
        assert record.state == "left", text[-3000:]
        assert not status.finished and status.round >= 1
        # every contribution it made was committed: no half-pushed round was left behind
        assert record.accepted == status.round and record.rejected == 0 and record.hash_ok
        assert "SIGTERM: the ranks leave after the current step" in text and "stop requested" in text
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
