"""Sites with every layout the README names (DDP, FSDP2, HSDP, tensor parallel, FSDP2 + TP),
in fp32 and in bf16, train one model.

Each rank pushes only the elements it owns and pulls its share of the update's chunks; the
replicas still agree bit for bit every round, hashed over the canonical parameters. The cyclic
sparsifier runs too: its kept set must come out the same from a tensor-parallel rank's strided
column shard, an FSDP2 rank's rows and the coordinator's contiguous chunks; each frame carries
its round and a CRC of its elements, so a chunk decoded anywhere else fails the push or pull.

bf16 is FSDP2's mixed precision policy where the layout shards (fsdp, hsdp, fsdp+tp) and
autocast elsewhere (ddp, tp); the parameters the outer sync hashes stay fp32, so bf16 sites
and fp32 sites agree bit for bit too.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from geodiloco.status import fetch_status, request_shutdown
from helpers import ledger_problems, round_log, spawn_geodiloco, start_coordinator_process, tiny_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LAYOUTS = {"site-ddp": "ddp", "site-fsdp": "fsdp", "site-tp": "tp"}


@pytest.mark.parametrize("codec", ["q8|zstd:3", "cyclic:0.4|q2|zstd:1"])
def test_sites_with_different_meshes_agree_every_round(tmp_path: Path, codec: str) -> None:
    # small chunks, so that chunks straddle shard boundaries and every rank pulls several
    cfg = tiny_config(
        rounds=3,
        sites=list(LAYOUTS),
        min_sites=len(LAYOUTS),  # every round waits for every layout
        compression__chunk_elements=700,
        compression__uplink=codec,
        compression__downlink=codec,
    )
    coordinator, target = start_coordinator_process(cfg, tmp_path)
    sites = []
    try:
        for name, layout in LAYOUTS.items():
            args = ["site", "run", "--name", name, "--coordinator", target, "--nproc", "2", "--insecure"]
            sites.append(spawn_geodiloco([*args, "--layout", layout], tmp_path / f"{name}.log"))
        for name, proc in zip(LAYOUTS, sites, strict=True):
            assert proc.wait(timeout=400) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        status = fetch_status(target, None)
        assert status.finished and [h.round for h in status.history] == [0, 1, 2]
        for record in status.history:
            assert sorted(record.contributors) == sorted(LAYOUTS)
            assert record.hash_reports == 3 and record.hashes_agree
            assert record.eval_count == cfg.data.eval_sequences
        for site in status.sites:
            assert site.accepted == 3 and site.rejected == 0 and site.hash_ok
        assert ledger_problems(round_log(tmp_path / "coord"), cfg) == []
        tp_log = (tmp_path / "site-tp.log").read_text()
        assert "layout: tp over 2 ranks" in tp_log
        request_shutdown(target, None)
        assert coordinator.wait(timeout=30) == 0
    finally:
        for proc in (*sites, coordinator):
            if proc.poll() is None:
                proc.kill()


# (site, ranks, layout, precision): 4-rank layouts next to 2-rank ones, all in bf16
BF16_RUNS = {
    "hsdp": [("site-hsdp", 4, "hsdp", "bf16"), ("site-ddp16", 2, "ddp", "bf16")],
    "fsdp+tp": [("site-fsdp-tp", 4, "fsdp+tp", "bf16"), ("site-tp16", 2, "tp", "bf16")],
    "fsdp": [("site-fsdp16", 2, "fsdp", "bf16"), ("site-fp32", 2, "ddp", "fp32")],
}


@pytest.mark.parametrize("run", list(BF16_RUNS))
def test_every_named_layout_trains_in_bf16_and_agrees(tmp_path: Path, run: str) -> None:
    sites = BF16_RUNS[run]
    cfg = tiny_config(rounds=3, sites=[name for name, *_ in sites], compression__chunk_elements=700)
    coordinator, target = start_coordinator_process(cfg, tmp_path)
    procs = []
    try:
        for name, ranks, layout, precision in sites:
            args = ["site", "run", "--name", name, "--coordinator", target, "--insecure", "--device", "cpu"]
            args += ["--nproc", str(ranks), "--layout", layout, "--mixed-precision", precision]
            procs.append(spawn_geodiloco(args, tmp_path / f"{name}.log"))
        for (name, *_), proc in zip(sites, procs, strict=True):
            assert proc.wait(timeout=400) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        status = fetch_status(target, None)
        assert status.finished and [h.round for h in status.history] == [0, 1, 2]
        for record in status.history:
            assert record.hash_reports == len(sites) and record.hashes_agree
            assert sorted(record.contributors) == sorted(name for name, *_ in sites)
        for name, ranks, layout, precision in sites:
            text = (tmp_path / f"{name}.log").read_text()
            assert f"layout: {layout} over {ranks} ranks" in text and f", {precision}) on cpu" in text
            losses = [
                float(line.rsplit("eval slice loss ", 1)[1])
                for line in text.splitlines()
                if "eval slice loss" in line
            ]
            assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
        request_shutdown(target, None)
        assert coordinator.wait(timeout=30) == 0
    finally:
        for proc in (*procs, coordinator):
            if proc.poll() is None:
                proc.kill()
