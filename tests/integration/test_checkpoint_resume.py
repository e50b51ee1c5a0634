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

from geodiloco.status import fetch_status, request_shutdown
from helpers import (
    kill_tree,
    ledger_problems,
    round_log,
    spawn_geodiloco,
    start_coordinator_process,
    tiny_config,
    wait_for_checkpoint,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def site_args(name: str, target: str, *extra: str) -> list[str]:
    return ["site", "run", "--name", name, "--coordinator", target, "--insecure", *extra]


def test_site_resumes_from_its_checkpoint_with_fewer_ranks(tmp_path: Path) -> None:
    # rounds of a few seconds; every round waits for both sites
    cfg = tiny_config(rounds=6, min_sites=2, lease_s=3.0, inner__steps_per_round=40)
    coordinator, target = start_coordinator_process(cfg, tmp_path)
    ckpt = tmp_path / "ckpt-a"
    a_args = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    procs = {
        "b": spawn_geodiloco(site_args("site-b", target, "--nproc", "2"), tmp_path / "b.log"),
        "a": spawn_geodiloco(
            site_args("site-a", target, "--nproc", "2", "--layout", "fsdp", *a_args), tmp_path / "a.log"
        ),
    }
    try:
        wait_for_checkpoint(ckpt, 2, {procs["a"]: tmp_path / "a.log"})
        kill_tree(procs["a"])
        saved = sorted(ckpt.glob("round-*/site.json"))[-1]
        meta = json.loads(saved.read_text())
        assert meta["ranks"] == 2 and meta["layout"] == "fsdp"

        procs["a"] = spawn_geodiloco(
            site_args("site-a", target, "--nproc", "1", *a_args), tmp_path / "a2.log"
        )
        for name, proc in procs.items():
            assert proc.wait(timeout=300) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        resumed = json.loads((ckpt / "resumed.json").read_text())
        assert resumed["ranks"] == 1 and resumed["checkpoint"] == saved.parent.name
        for key in ("state_hash", "params_hash", "residual_hash"):
            assert resumed[key] == meta[key], key
        assert "resumed from round-" in (tmp_path / "a2.log").read_text()

        status = fetch_status(target, None)
        assert status.finished and [h.round for h in status.history] == list(range(6))
        assert all(sorted(h.contributors) == ["site-a", "site-b"] for h in status.history)
        assert status.history[-1].hashes_agree and status.history[-1].hash_reports == 2
        assert ledger_problems(round_log(tmp_path / "coord"), cfg) == []
        request_shutdown(target, None)
        assert coordinator.wait(timeout=30) == 0
    finally:
        for proc in (*procs.values(), coordinator):
            if proc.poll() is None:
                proc.kill()
