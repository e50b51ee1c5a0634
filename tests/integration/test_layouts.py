"""Sites with different meshes (DDP, FSDP2, tensor parallel) train one model.

Each rank pushes only the elements it owns and pulls its share of the update's chunks; the
replicas still agree bit for bit every round, hashed over the canonical parameters. The cyclic
sparsifier runs too: its kept set must come out the same from a tensor-parallel rank's strided
column shard, an FSDP2 rank's rows and the coordinator's contiguous chunks; each frame carries
its round and a CRC of its elements, so a chunk decoded anywhere else fails the push or pull.

The q8 run trains its FSDP2 site in bf16 (FSDP2's mixed precision policy) next to fp32 sites:
the parameters the outer sync hashes stay fp32, so they agree bit for bit too. The 4-rank
layouts in bf16 are in test_layouts_bf16.py (a file of its own, so that two workers share them).

Two sites spread each rank's push and pull over several TCP connections (``--streams``): their
ranks push a part per stream and share the chunks their streams pulled by the same rule.

The coordinator is a process; each site is the site daemon on 2 real gloo ranks, from the test
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

# site: (layout, precision), 2 ranks each
MESHES = {
    "q8|zstd:3": {"site-ddp": ("ddp", "fp32"), "site-fsdp": ("fsdp", "bf16"), "site-tp": ("tp", "fp32")},
    "cyclic:0.4|q2|zstd:1": {
        "site-ddp": ("ddp", "fp32"),
        "site-fsdp": ("fsdp", "fp32"),
        "site-tp": ("tp", "fp32"),
    },
}

STREAMS = {"site-tp": "3", "site-fsdp": "2"}  # connections per rank; the others keep one


@pytest.mark.parametrize("codec", list(MESHES))
def test_sites_with_different_meshes_agree_every_round(
    rank_pool: RankPool, tmp_path: Path, codec: str
) -> None:
    sites = MESHES[codec]
    # small chunks, so that chunks straddle shard boundaries and every rank pulls several
    cfg = tiny_config(
        rounds=3,
        sites=list(sites),
        min_sites=len(sites),  # every round waits for every layout
        compression__chunk_elements=700,
        compression__uplink=codec,
        compression__downlink=codec,
    )
    with SitesRun(cfg, tmp_path) as run:
        flags = {
            name: (2, ["--layout", layout, "--mixed-precision", precision, "--streams", streams])
            for name, (layout, precision) in sites.items()
            for streams in [STREAMS.get(name, "1")]
        }
        run_sites(rank_pool, run.target, flags, tmp_path)
        status = run.status()
        assert status.finished and [h.round for h in status.history] == [0, 1, 2]
        for record in status.history:
            assert sorted(record.contributors) == sorted(sites)
            assert record.hash_reports == 3 and record.hashes_agree
            assert record.eval_count == cfg.data.eval_sequences
        for site in status.sites:
            assert site.accepted == 3 and site.rejected == 0 and site.hash_ok
        for name, (layout, precision) in sites.items():
            text = run.log(name).read_text()
            assert f"layout: {layout} over 2 ranks" in text and f", {precision}) on cpu" in text
            assert len(eval_losses(text)) == 3
        run.finish()
