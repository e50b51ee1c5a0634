"""A site killed after a checkpoint comes back with another rank count and another layout.

Site A (FSDP2 over 2 ranks) checkpoints every round; it is SIGKILLed mid-run and restarted as
one plain rank from the same directory. The round waits for it (min_sites: every site), so it
resumes exactly where the checkpoint left it: the state it loads hashes, over the canonical
parameters, to what was saved, and the run finishes with every replica in agreement.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from geodiloco.testing.configs import tiny_config
from geodiloco.testing.processes import SitesRun, kill_tree, wait_for_checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_site_resumes_from_its_checkpoint_with_fewer_ranks(tmp_path: Path) -> None:
    # rounds of a few seconds; every round waits for both sites
    cfg = tiny_config(rounds=6, min_sites=2, lease_s=3.0, inner__steps_per_round=40)
    ckpt = tmp_path / "ckpt-a"
    a_args = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    with SitesRun(cfg, tmp_path) as run:
        run.start("site-b", "--nproc", "2", key="b")
        run.start("site-a", "--nproc", "2", "--layout", "fsdp", *a_args, key="a")
        wait_for_checkpoint(ckpt, 2, {run.procs["a"]: run.log("a")})
        kill_tree(run.procs["a"])
        saved = sorted(ckpt.glob("round-*/site.json"))[-1]
        meta = json.loads(saved.read_text())
        assert meta["ranks"] == 2 and meta["layout"] == "fsdp"

        run.start("site-a", "--nproc", "1", *a_args, key="a2")
        run.wait("b", "a2", timeout=300)
        resumed = json.loads((ckpt / "resumed.json").read_text())
        assert resumed["ranks"] == 1 and resumed["checkpoint"] == saved.parent.name
        for key in ("state_hash", "params_hash", "residual_hash"):
            assert resumed[key] == meta[key], key
        assert "resumed from round-" in run.log("a2").read_text()

        status = run.status()
        assert status.finished and [h.round for h in status.history] == list(range(6))
        assert all(sorted(h.contributors) == ["site-a", "site-b"] for h in status.history)
        assert status.history[-1].hashes_agree and status.history[-1].hash_reports == 2
        run.finish()
