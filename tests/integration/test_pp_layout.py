"""Pipeline-parallel sites train next to DDP sites, and a checkpoint of stages resumes without.

A ``pp=2`` site (two stages, one rank each) and a DDP site train one model: each stage's rank
pushes the elements it owns and every round's hashes agree. The stage site checkpoints every
round, is SIGKILLed, and comes back as one plain rank from the same directory: its DCP checkpoint
is keyed by canonical names (both stages' parameters, the tied embedding once), so the state it
loads hashes to what the stages saved. Then stages composed with FSDP2 (``pp=2,dp_shard=2``),
whose sites are the site daemon on real gloo ranks from the test worker's pool of rank processes
(tests/rank_pool.py: the layout is the point there; the first test starts, kills and restarts
real `geodiloco site run` processes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from geodiloco.params import canonical_parameters
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.processes import SitesRun, kill_tree, wait_for_checkpoint
from geodiloco.testing.rank_pool import RankPool, run_sites
from geodiloco.workload import GPTConfig, build_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = {"n_layer": 2, "n_head": 2, "d_model": 16, "seq_len": 16}  # a block per stage


def test_pp_site_agrees_with_ddp_and_its_checkpoint_resumes_under_ddp(tmp_path: Path) -> None:
    cfg = tiny_config(
        rounds=5,
        sites=["site-ddp", "site-pp"],
        min_sites=2,
        lease_s=3.0,
        model=MODEL,
        inner__steps_per_round=20,
        compression__chunk_elements=700,
    )
    ckpt = tmp_path / "ckpt-pp"
    pp_args = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    with SitesRun(cfg, tmp_path) as run:
        run.start("site-ddp", "--nproc", "2", key="ddp")
        run.start("site-pp", "--nproc", "2", "--layout", "pp=2", *pp_args, key="pp")
        wait_for_checkpoint(ckpt, 2, {run.procs["pp"]: run.log("pp")})
        kill_tree(run.procs["pp"])
        saved = sorted(ckpt.glob("round-*/site.json"))[-1]
        meta = json.loads(saved.read_text())
        assert meta["ranks"] == 2 and meta["layout"] == "pp"
        assert "layout: pp over 2 ranks (pp=2 x 2 microbatches" in run.log("pp").read_text()
        # canonical names from both stages: the whole model, as a site without stages keeps it
        keys = set(dcp.FileSystemReader(str(saved.parent)).read_metadata().state_dict_metadata)
        names = [n for n, _ in canonical_parameters(build_model(GPTConfig(**MODEL), seed=0))]
        for part in ("model", "snapshot", "residual"):
            assert {f"{part}.{n}" for n in names} <= keys, part

        run.start("site-pp", "--nproc", "1", *pp_args, key="pp2")
        run.wait("ddp", "pp2", timeout=300)
        resumed = json.loads((ckpt / "resumed.json").read_text())
        assert resumed["ranks"] == 1 and resumed["checkpoint"] == saved.parent.name
        for key in ("state_hash", "params_hash", "residual_hash"):
            assert resumed[key] == meta[key], key

        status = run.status()
        assert status.finished and [h.round for h in status.history] == list(range(5))
        assert all(sorted(h.contributors) == ["site-ddp", "site-pp"] for h in status.history)
        for record in status.history[:2]:  # trained by the stages, reported by both sites
            assert record.hash_reports == 2 and record.hashes_agree
        assert status.history[-1].hashes_agree and status.history[-1].hash_reports == 2
        run.finish()


def test_pp_with_fsdp_site_agrees_with_ddp_every_round(rank_pool: RankPool, tmp_path: Path) -> None:
    sites = {"site-pp-fsdp": (4, "pp=2,dp_shard=2"), "site-ddp": (1, "ddp")}
    cfg = tiny_config(rounds=3, sites=list(sites), min_sites=2, model=MODEL, compression__chunk_elements=700)
    with SitesRun(cfg, tmp_path) as run:
        flags = {name: (ranks, ["--layout", layout]) for name, (ranks, layout) in sites.items()}
        run_sites(rank_pool, run.target, flags, tmp_path)
        status = run.status()
        assert status.finished and [h.round for h in status.history] == [0, 1, 2]
        for record in status.history:
            assert sorted(record.contributors) == sorted(sites)
            assert record.hash_reports == 2 and record.hashes_agree
            assert record.eval_count == cfg.data.eval_sequences  # each batch counted once
        text = run.log("site-pp-fsdp").read_text()
        assert "layout: pp+fsdp over 4 ranks" in text and text.count("eval slice loss") == 3
        run.finish()
