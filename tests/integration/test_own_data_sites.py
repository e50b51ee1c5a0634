"""Data as people write it, at real sites: a map-style dataset, an iterable and a sampler with
replacement each train across two sites with every ledger item used once, while the coordinator
(whose datasets raise if an item is read outside a site's ranks) only asks for sizes.

The coordinator is a process; each site is the site daemon on a real gloo rank from the test
worker's pool of rank processes (tests/rank_pool.py), given the tests' folder as PYTHONPATH
would give it; the launcher and torchrun are started by the other integration tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from geodiloco.app.status import fetch_status, request_shutdown
from geodiloco.config import load_config
from geodiloco.testing.audits import ledger_problems, round_log
from geodiloco.testing.processes import kill_tree, start_coordinator_process
from geodiloco.testing.rank_pool import RankPool, run_sites

pytestmark = pytest.mark.integration
WORKLOAD_TESTS = Path(__file__).resolve().parents[1] / "workload"
ROUNDS = 2


@pytest.mark.parametrize("kind", ["map_style", "iterable", "sampler"])
def test_each_kind_of_dataset_trains_at_two_sites_and_the_coordinator_reads_no_item(
    rank_pool: RankPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(WORKLOAD_TESTS), os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.syspath_prepend(str(WORKLOAD_TESTS))  # the ledger audit below sizes the data too
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cfg = load_config(
        None,
        [
            f"run_id=own-data-{kind.replace('_', '-')}",
            f"rounds={ROUNDS}",
            "min_sites=2",
            "heartbeat_interval_s=0.5",
            "lease_s=10",
            "workload.model=test_datasets:classifier",
            "workload.optimizer=test_datasets:sgd",
            f"workload.data=test_datasets:{kind}",
            "data.shards=4",
            "data.batch_size=4",
            "inner.steps_per_round=3",
        ],
    )
    coordinator, target = start_coordinator_process(cfg, tmp_path)
    try:
        sites = dict.fromkeys(cfg.sites, (1, []))
        run_sites(rank_pool, target, sites, tmp_path, timeout=180, paths=[str(WORKLOAD_TESTS)])
        status = fetch_status(target, None)
        assert status.finished and [h.round for h in status.history] == list(range(ROUNDS))
        assert all(h.hashes_agree and h.hash_reports == 2 for h in status.history)
        assert ledger_problems(round_log(tmp_path / "coord"), cfg) == []
        consumed = sum(e - s for entry in round_log(tmp_path / "coord") for _, _, s, e, _ in entry["data"])
        assert consumed == ROUNDS * 2 * 3 * 4  # rounds x sites x steps x batch: items, once each
        request_shutdown(target, None)
        assert coordinator.wait(timeout=60) == 0
    finally:
        if coordinator.poll() is None:
            kill_tree(coordinator)
    assert "outside a site's ranks" not in (tmp_path / "coordinator.log").read_text()
