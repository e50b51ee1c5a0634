"""A real run: a coordinator process and two site processes (2 torchrun ranks each)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from geodiloco.app.status import fetch_status, request_shutdown
from geodiloco.testing.audits import ledger_problems
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.processes import spawn_geodiloco, start_coordinator_process

pytestmark = pytest.mark.integration


def test_two_sites_stay_bit_identical_every_round(tmp_path: Path) -> None:
    cfg = tiny_config(rounds=4, min_sites=2)  # every round waits for both sites
    coordinator, target = start_coordinator_process(cfg, tmp_path)
    sites = []
    try:
        sites = [
            spawn_geodiloco(
                ["site", "run", "--name", name, "--coordinator", target, "--nproc", "2", "--insecure"],
                tmp_path / f"{name}.log",
            )
            for name in cfg.sites
        ]
        for name, proc in zip(cfg.sites, sites, strict=True):
            assert proc.wait(timeout=240) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        status = fetch_status(target, None)
        assert status.finished and status.round == 4
        assert [h.round for h in status.history] == [0, 1, 2, 3]
        for record in status.history:
            assert sorted(record.contributors) == ["site-a", "site-b"]
            assert record.hash_reports == 2 and record.hashes_agree
            assert record.eval_count == cfg.data.eval_sequences  # the sites' slices cover the eval set
        assert len({h.state_hash for h in status.history}) == 4
        losses = [h.eval_loss for h in status.history]
        assert losses[-1] < losses[0]
        for site in status.sites:
            assert site.state == "left" and site.accepted == 4 and site.rejected == 0 and site.hash_ok
            assert site.bytes_in > 0 and site.bytes_out > 0
        logged = [json.loads(line) for line in (tmp_path / "coord" / "rounds.jsonl").read_text().splitlines()]
        assert [r["state_hash"] for r in logged] == [h.state_hash for h in status.history]
        assert ledger_problems(logged, cfg) == []
        windows = cfg.rounds * 2 * cfg.inner.steps_per_round * 2 * cfg.data.batch_size
        assert status.data_windows_consumed == windows
        request_shutdown(target, None)
        assert coordinator.wait(timeout=30) == 0
    finally:
        for proc in (*sites, coordinator):
            if proc.poll() is None:
                proc.kill()
