"""A site that spans two "nodes" next to a one-node site, on loopback.

Site ``site-multi`` is two ``geodiloco site run`` processes (2 ranks each) that meet through
torchrun's c10d rendezvous and train as one group of 4 ranks, tensor parallel inside a node and
FSDP2 across the two (``fsdp+tp``); ``site-single`` is one process of 2 DDP ranks. Rounds wait
for ``site-multi`` (the quorum is every site). Node 1 is SIGKILLed (launcher, torchrun and
ranks, as if its machine died) once a checkpoint is on disk: node 0 must fail too (the site
fails as a whole), and the site comes back on one node of 2 FSDP2 ranks from the 4-rank
checkpoint (the state, parameters and error-feedback residual it loads hash to what was saved),
rejoins and finishes. Every round, both sites' hashes agree with the coordinator's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from geodiloco.site.parallel.checkpoint import read_meta
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.processes import SitesRun, kill_tree, wait_for_checkpoint
from geodiloco.testing.servers import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SITES = ["site-multi", "site-single"]
ROUNDS = 6


def test_two_node_site_agrees_fails_as_a_whole_and_resumes_on_one_node(tmp_path: Path) -> None:
    # min_sites = both: the run waits for the multi-node site to come back rather than finishing without it
    cfg = tiny_config(
        rounds=ROUNDS, sites=SITES, min_sites=len(SITES), lease_s=4.0, inner__steps_per_round=16
    )
    ckpt, rdzv = tmp_path / "ckpt", f"127.0.0.1:{free_port()}"
    multi = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]

    def node(rank: int) -> list[str]:
        return ["--nproc", "2", "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", rdzv]

    layout = ["--layout", "fsdp+tp"]

    with SitesRun(cfg, tmp_path) as run:
        run.start("site-single", "--nproc", "2", key="single")
        run.start("site-multi", *node(0), *layout, *multi, key="node0")
        run.start("site-multi", *node(1), *layout, *multi, key="node1")
        wait_for_checkpoint(ckpt, 2, {run.procs[n]: run.log(n) for n in ("node0", "node1")})
        both = run.log("node0").read_text() + run.log("node1").read_text()
        assert "layout: fsdp+tp over 4 ranks" in both  # one group of both nodes' ranks
        kill_tree(run.procs["node1"])  # the machine of node 1 dies
        assert run.procs["node0"].wait(timeout=180) != 0, "node 0 went on without node 1"
        latest = sorted(ckpt.glob("round-*/site.json"))[-1].parent
        saved = read_meta(latest)  # what the site will come back from
        assert saved.ranks == 4 and saved.layout == "fsdp+tp"

        # back on one node: 2 ranks, from the 4-rank checkpoint
        run.start("site-multi", "--nproc", "2", "--layout", "fsdp", *multi, key="again")
        run.wait("single", "again")
        again = run.log("again").read_text()
        assert "resumed from round-0000" in again and "4 ranks before, 2 now" in again
        resumed = json.loads((ckpt / "resumed.json").read_text())
        assert resumed["checkpoint"] == latest.name and resumed["ranks"] == 2
        for key in ("state_hash", "params_hash", "residual_hash"):
            assert resumed[key] == getattr(saved, key), key

        status = run.status()
        assert status.finished and [h.round for h in status.history] == list(range(ROUNDS))
        for record in status.history:  # the quorum is every site: both in every round
            assert sorted(record.contributors) == SITES
            assert record.hash_reports == 2 and record.hashes_agree, record
        for site in status.sites:
            assert site.hash_ok and site.rejected == 0, site
        run.finish()
