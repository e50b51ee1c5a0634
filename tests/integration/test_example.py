"""The example in examples/ runs for real: a user's MLP (not the reference model) trained by two
sites, one with its own torchrun loop around OuterSync (DDP), one by `geodiloco site run`
through the config's builder route (FSDP2), against a coordinator that builds θ_0 and the data
ledger with the same builders."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from geodiloco.app.status import fetch_status, request_shutdown
from geodiloco.builders import build_data, build_loss, build_model
from geodiloco.config import load_config
from geodiloco.testing.audits import ledger_problems, round_log
from geodiloco.testing.processes import kill_tree, spawn_geodiloco, start_coordinator_process
from geodiloco.workload.steps import evaluate_batches

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ROUNDS = 4


def test_example_trains_its_own_model_through_the_api_and_the_builders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the coordinator and both sites import the example's builders from here
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.syspath_prepend(str(EXAMPLES))
    cfg = load_config(EXAMPLES / "mlp_teacher.toml", [f"rounds={ROUNDS}", "min_sites=2"])  # both, every round
    data = build_data(cfg)
    initial_loss, count = evaluate_batches(build_model(cfg), data.eval_batches(0, 1), build_loss(cfg))
    initial_loss /= count

    coordinator, target = start_coordinator_process(cfg, tmp_path)
    procs = []
    try:
        with open(tmp_path / "site-1.log", "ab") as out:
            own_loop = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
            own_loop += [str(EXAMPLES / "train_mlp_teacher.py"), "--coordinator", target, "--site", "site-1"]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            procs.append(
                subprocess.Popen(
                    own_loop, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            )
        daemon = ["site", "run", "--name", "site-2", "--coordinator", target, "--nproc", "2", "--insecure"]
        procs.append(spawn_geodiloco([*daemon, "--layout", "fsdp"], tmp_path / "site-2.log"))
        for name, proc in zip(("site-1", "site-2"), procs, strict=True):
            assert proc.wait(timeout=400) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]

        status = fetch_status(target, None)
        assert status.finished and [h.round for h in status.history] == list(range(ROUNDS))
        for record in status.history:
            assert sorted(record.contributors) == ["site-1", "site-2"]
            assert record.hash_reports == 2 and record.hashes_agree  # DDP loop == FSDP2 daemon
            assert record.eval_count == cfg.workload.options["eval_items"]
        for site in status.sites:
            assert site.accepted == ROUNDS and site.rejected == 0 and site.hash_ok
        losses = [h.eval_loss for h in status.history]
        assert losses[-1] < losses[0] < initial_loss, (initial_loss, losses)
        assert losses[-1] < 0.8 * initial_loss, (initial_loss, losses)
        assert ledger_problems(round_log(tmp_path / "coord"), cfg) == []
        assert f"round {ROUNDS - 1}: eval loss" in (tmp_path / "site-1.log").read_text()
        assert "layout: fsdp over 2 ranks" in (tmp_path / "site-2.log").read_text()
        request_shutdown(target, None)
        assert coordinator.wait(timeout=30) == 0
    finally:
        for proc in (*procs, coordinator):
            if proc.poll() is None:
                kill_tree(proc)  # torchrun's ranks run in sessions of their own
