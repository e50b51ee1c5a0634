"""Users' own models at real sites: a Hugging Face Llama trained by a DDP site and an FSDP2 +
tensor-parallel site (FSDP2 per decoder layer, attention heads and MLP split across 2 ranks;
hashes agree every round), then exported and read back by transformers with the coordinator's
logits; and a site whose builders do not load leaves with one line, before training.

The Llama's sites are the site daemon on real gloo ranks from the test worker's pool of rank
processes (tests/rank_pool.py), against a coordinator process; the site that does not load is a
real `geodiloco site run` (its one line passes through torchrun)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers

from geodiloco.app import cli
from geodiloco.app.export import model_with, read_committed
from geodiloco.app.status import fetch_status, request_shutdown
from geodiloco.config import load_config
from geodiloco.testing.audits import round_log
from geodiloco.testing.processes import kill_tree, spawn_geodiloco, start_coordinator_process
from geodiloco.testing.rank_pool import RankPool, run_sites
from geodiloco.workload.hf import tiny_llama

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROUNDS = 2
TESTS = Path(__file__).resolve().parents[1]


def test_a_hf_llama_trains_at_a_ddp_and_an_fsdp_tp_site_and_exports_to_the_same_logits(
    rank_pool: RankPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tiny_llama(5).save_pretrained(tmp_path / "pre")
    cfg = load_config(
        None,
        [
            "run_id=hf-sites",
            f"rounds={ROUNDS}",
            "heartbeat_interval_s=0.5",
            "lease_s=10",
            "workload.model=geodiloco.workload.hf:build_model",
            f'workload.options.hf_model="{tmp_path / "pre"}"',
            f'workload.init_weights="{tmp_path / "pre"}"',
            "model.seq_len=32",
            "data.max_bytes=300000",
            "data.eval_sequences=16",
            "data.batch_size=4",
            "inner.steps_per_round=4",
        ],
    )
    coordinator, target = start_coordinator_process(cfg, tmp_path)
    try:
        sites = {"site-1": (1, ["--layout", "ddp"]), "site-2": (4, ["--layout", "fsdp+tp"])}
        run_sites(rank_pool, target, sites, tmp_path, timeout=500, env={"HF_HUB_OFFLINE": "1"})
        status = fetch_status(target, None)
        assert status.finished and [h.round for h in status.history] == list(range(ROUNDS))
        for record in status.history:
            assert record.hash_reports == 2 and record.hashes_agree  # DDP == FSDP2 + TP, bit for bit
        assert "layout: fsdp+tp over 4 ranks" in (tmp_path / "site-2.log").read_text()
        losses = [h.eval_loss for h in status.history]
        assert losses[-1] < losses[0], losses
        request_shutdown(target, None)
        assert coordinator.wait(timeout=60) == 0
    finally:
        if coordinator.poll() is None:
            kill_tree(coordinator)
    out = tmp_path / "export"
    argv = ["export", str(tmp_path / "coord"), "--config", str(tmp_path / "run.json"), "--out", str(out)]
    assert cli.main(argv) == 0
    committed = read_committed(tmp_path / "coord", cfg, None)
    assert committed.round == ROUNDS
    assert committed.state_hash == round_log(tmp_path / "coord")[-1]["state_hash"]
    assert json.loads((out / "geodiloco-export.json").read_text())["state_hash"] == committed.state_hash
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours = model_with(cfg, committed.theta).eval()
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, ours(x).logits)


def test_a_site_whose_builders_do_not_load_leaves_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the coordinator has the user's module, the site does not (a deployment mistake)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    )
    cfg = load_config(None, ["workload.loss=test_loss_contract:plain_cross_entropy", "model.n_layer=1"])
    coordinator, target = start_coordinator_process(cfg, tmp_path)
    monkeypatch.delenv("PYTHONPATH")
    try:
        site = spawn_geodiloco(
            ["site", "run", "--name", "site-1", "--coordinator", target, "--insecure", "--nproc", "2"],
            tmp_path / "site.log",
        )
        assert site.wait(timeout=120) != 0
    finally:
        kill_tree(coordinator)
    log = (tmp_path / "site.log").read_text()
    line = "invalid config: workload.loss: cannot import module 'test_loss_contract'"
    assert f"geodiloco site: {line}" in log
    assert f"traceback : {line}" in log  # torchrun's box shows the cause, not "<N/A>"
    assert "[rank0]" not in log and "[rank1]" not in log  # no rank printed a Python traceback
