"""A mixture-of-experts model trained by an expert-parallel site (4 experts over 2 ranks) next to
a DDP site: each EP rank pushes the experts it holds (and its share of the replicated rest), and
both sites hold the same parameters, bit for bit, after every round."""

from __future__ import annotations

from pathlib import Path

import pytest

from geodiloco.status import fetch_status, request_shutdown
from helpers import ledger_problems, round_log, spawn_geodiloco, start_coordinator_process, tiny_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SITES = {"site-ep": ("ep", 2), "site-ddp": ("ddp", 1)}


def test_expert_parallel_site_agrees_with_a_ddp_site_every_round(tmp_path: Path) -> None:
    cfg = tiny_config(
        rounds=3,
        sites=list(SITES),
        min_sites=len(SITES),  # every round waits for both layouts
        model__experts=4,
        model__top_k=2,
        compression__chunk_elements=700,  # chunks straddle the expert shards' boundaries
    )
    coordinator, target = start_coordinator_process(cfg, tmp_path)
    procs = []
    try:
        for name, (layout, ranks) in SITES.items():
            args = ["site", "run", "--name", name, "--coordinator", target, "--insecure", "--device", "cpu"]
            args += ["--nproc", str(ranks), "--layout", layout]
            procs.append(spawn_geodiloco(args, tmp_path / f"{name}.log"))
        for name, proc in zip(SITES, procs, strict=True):
            assert proc.wait(timeout=400) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        status = fetch_status(target, None)
        assert status.finished and [h.round for h in status.history] == [0, 1, 2]
        for record in status.history:
            assert sorted(record.contributors) == sorted(SITES)
            assert record.hash_reports == len(SITES) and record.hashes_agree
            assert record.eval_count == cfg.data.eval_sequences
        for site in status.sites:
            assert site.accepted == 3 and site.rejected == 0 and site.hash_ok
        assert ledger_problems(round_log(tmp_path / "coord"), cfg) == []
        assert (
            "layout: ep over 2 ranks (dp_replicate=2, dp_shard=1, tp=1, ep=2, fp32)"
            in (tmp_path / "site-ep.log").read_text()
        )
        request_shutdown(target, None)
        assert coordinator.wait(timeout=30) == 0
    finally:
        for proc in (*procs, coordinator):
            if proc.poll() is None:
                proc.kill()
