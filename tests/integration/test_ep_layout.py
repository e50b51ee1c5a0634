"""A mixture-of-experts model trained by an expert-parallel site (4 experts over 2 ranks) next to
a DDP site: each EP rank pushes the experts it holds (and its share of the replicated rest), and
both sites hold the same parameters, bit for bit, after every round.

The coordinator is a process; each site is the site daemon on real gloo ranks, from the test
worker's pool of rank processes (tests/rank_pool.py: the layouts are the point here, the
launcher and torchrun are started by the other integration tests).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from geodiloco.testing.configs import tiny_config
from geodiloco.testing.processes import SitesRun
from geodiloco.testing.rank_pool import RankPool, run_sites

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SITES = {"site-ep": ("ep", 2), "site-ddp": ("ddp", 1)}


def test_expert_parallel_site_agrees_with_a_ddp_site_every_round(rank_pool: RankPool, tmp_path: Path) -> None:
    cfg = tiny_config(
        rounds=3,
        sites=list(SITES),
        min_sites=len(SITES),  # every round waits for both layouts
        model__experts=4,
        model__top_k=2,
        compression__chunk_elements=700,  # chunks straddle the expert shards' boundaries
    )
    with SitesRun(cfg, tmp_path) as run:
        flags = {name: (ranks, ["--layout", layout]) for name, (layout, ranks) in SITES.items()}
        run_sites(rank_pool, run.target, flags, tmp_path)
        status = run.status()
        assert status.finished and [h.round for h in status.history] == [0, 1, 2]
        for record in status.history:
            assert sorted(record.contributors) == sorted(SITES)
            assert record.hash_reports == len(SITES) and record.hashes_agree
            assert record.eval_count == cfg.data.eval_sequences
        for site in status.sites:
            assert site.accepted == 3 and site.rejected == 0 and site.hash_ok
        assert (
            "layout: ep over 2 ranks (dp_replicate=2, dp_shard=1, tp=1, ep=2, fp32)"
            in run.log("site-ep").read_text()
        )
        run.finish()
