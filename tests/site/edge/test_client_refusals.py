"""What an operator sees of a site the run refuses (issue 16 item 8): one line naming why, not
every rank's traceback and torchrun's failure box; and a site resynced to a later round reports
no train loss from the round it trained for nothing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from geodiloco.security.secrets import RUN_SECRET, new_run_secret, write_site_secret
from geodiloco.site.daemon.launcher import EXIT_REFUSED
from geodiloco.site.daemon.worker import round_train_loss
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.processes import kill_tree, spawn_geodiloco
from geodiloco.testing.servers import CoordinatorThread, free_port


def test_train_loss_is_reported_only_for_the_round_it_trained() -> None:
    assert round_train_loss([2.0, 4.0], trained_round=3, closed_round=3) == 3.0
    assert math.isnan(round_train_loss([2.0, 4.0], trained_round=3, closed_round=7))  # resynced


def run_site(tmp_path: Path, coordinator: CoordinatorThread, *extra: str) -> tuple[int, str]:
    """A real 2-rank `geodiloco site run`: its exit code and everything it printed."""
    args = ["site", "run", "--name", "site-a", "--coordinator", coordinator.target, "--nproc", "2"]
    site = spawn_geodiloco([*args, "--insecure", *extra], tmp_path / "site.log")
    try:
        code = site.wait(timeout=180)
    finally:
        if site.poll() is None:
            kill_tree(site)
    return code, (tmp_path / "site.log").read_text()


@pytest.mark.integration
def test_a_site_refused_at_join_says_why_in_one_line(tmp_path: Path) -> None:
    """A refusal only the ranks' Join finds (the declared world exceeds the run's limit)."""
    with CoordinatorThread(tiny_config(limits__max_world_size=1)) as coordinator:
        code, output = run_site(tmp_path, coordinator)
    refusals = [line for line in output.splitlines() if "join refused" in line]
    assert len(refusals) == 1, output  # said once, by rank 0
    assert refusals[0] == (
        "geodiloco site: join refused: INVALID_ARGUMENT: world_size 2 exceeds limits.max_world_size 1"
    )
    assert "Traceback" not in output and "ChildFailedError" not in output, output
    assert code == EXIT_REFUSED


@pytest.mark.integration
def test_a_refusal_reaches_every_node_of_a_site(tmp_path: Path) -> None:
    """A site of two nodes (two `geodiloco site run` processes meeting through torchrun's
    rendezvous, as in tests/integration/test_multinode.py), refused at Join: the node without
    global rank 0 learns why too, says it once and exits 78, not with a traceback."""
    rdzv = f"127.0.0.1:{free_port()}"
    with CoordinatorThread(tiny_config(limits__max_world_size=1)) as coordinator:
        nodes = []
        for rank in (0, 1):
            args = ["site", "run", "--name", "site-a", "--coordinator", coordinator.target, "--insecure"]
            args += ["--nproc", "1", "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", rdzv]
            nodes.append(spawn_geodiloco(args, tmp_path / f"node{rank}.log"))
        try:
            codes = [node.wait(timeout=180) for node in nodes]
        finally:
            for node in nodes:
                if node.poll() is None:
                    kill_tree(node)
    for rank, code in enumerate(codes):
        output = (tmp_path / f"node{rank}.log").read_text()
        refusals = [line for line in output.splitlines() if "join refused" in line]
        assert refusals == [
            "geodiloco site: join refused: INVALID_ARGUMENT: world_size 2 exceeds limits.max_world_size 1"
        ], output
        assert "Traceback" not in output and "ChildFailedError" not in output, output
        assert code == EXIT_REFUSED, (rank, output)


@pytest.mark.integration
def test_a_site_whose_secret_cannot_be_used_is_refused_before_its_ranks_start(tmp_path: Path) -> None:
    new_run_secret(tmp_path / RUN_SECRET)
    secret = write_site_secret(tmp_path, "site-a")  # the coordinator (--insecure) seals nothing
    with CoordinatorThread(tiny_config()) as coordinator:
        code, output = run_site(tmp_path, coordinator, "--secret", str(secret))
        assert coordinator.controller.sites["site-a"].state == "absent"  # the probe admits nobody
    refusals = [line for line in output.splitlines() if "refuses site 'site-a'" in line]
    assert len(refusals) == 1 and "in the clear" in refusals[0], output
    assert "Traceback" not in output and "join refused" not in output, output  # no rank started
    assert code == 2
