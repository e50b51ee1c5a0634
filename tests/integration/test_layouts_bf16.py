"""The 4-rank layouts the README names (HSDP, FSDP2 + tensor parallel) train in bf16 next to
2-rank ones (DDP, tensor parallel) and agree bit for bit every round.

bf16 is FSDP2's mixed precision policy where the layout shards (hsdp, fsdp+tp) and autocast
elsewhere (ddp, tp); the parameters the outer sync hashes stay fp32. FSDP2 alone in bf16 runs
in test_layouts.py.

The coordinator is a process; each site is the site daemon on real gloo ranks, from the test
worker's pool of rank processes (tests/rank_pool.py: the layouts are the point here, the
launcher and torchrun are started by the other integration tests).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from geodiloco.testing.audits import eval_losses
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.processes import SitesRun
from geodiloco.testing.rank_pool import RankPool, run_sites

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# (site, ranks, layout, precision): 4-rank layouts next to 2-rank ones, all in bf16
BF16_RUNS = {
    "hsdp": [("site-hsdp", 4, "hsdp", "bf16"), ("site-ddp16", 2, "ddp", "bf16")],
    "fsdp+tp": [("site-fsdp-tp", 4, "fsdp+tp", "bf16"), ("site-tp16", 2, "tp", "bf16")],
}


@pytest.mark.parametrize("run", list(BF16_RUNS))
def test_every_named_layout_trains_in_bf16_and_agrees(rank_pool: RankPool, tmp_path: Path, run: str) -> None:
    sites = BF16_RUNS[run]
    cfg = tiny_config(rounds=3, sites=[name for name, *_ in sites], compression__chunk_elements=700)
    with SitesRun(cfg, tmp_path) as processes:
        flags = {
            name: (ranks, ["--layout", layout, "--mixed-precision", precision])
            for name, ranks, layout, precision in sites
        }
        run_sites(rank_pool, processes.target, flags, tmp_path)
        status = processes.status()
        assert status.finished and [h.round for h in status.history] == [0, 1, 2]
        for record in status.history:
            assert record.hash_reports == len(sites) and record.hashes_agree
            assert sorted(record.contributors) == sorted(name for name, *_ in sites)
        for name, ranks, layout, precision in sites:
            text = processes.log(name).read_text()
            assert f"layout: {layout} over {ranks} ranks" in text and f", {precision}) on cpu" in text
            assert len(eval_losses(text)) == 3
        processes.finish()
