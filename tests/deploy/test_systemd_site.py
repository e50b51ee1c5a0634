"""The site unit as systemd would start it: ExecStart with the unit's environment (Environment=,
then an EnvironmentFile made from site.env.example), under ProtectSystem=strict and PrivateTmp
(rebuilt in a mount namespace: read-only everywhere but the unit's writable paths), against a
coordinator with mTLS and sealed payloads. The site trains the run and writes its checkpoints
where the unit allows; a write anywhere else is refused by the same sandbox."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from systemd_units import EXECUTABLE, SYSTEMD, Roots, Unit, sandbox_problem, sandboxed

from geodiloco.security.pki import PkiDir
from geodiloco.security.policy import ServerSecurity
from geodiloco.security.sealing import Keyring
from geodiloco.security.secrets import load_secret
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.processes import kill_tree
from geodiloco.testing.servers import CoordinatorThread, free_port

pytestmark = pytest.mark.integration
SITE = "site-1"


def env_file(pki: Path, coordinator: str) -> str:
    """site.env.example as an operator edits it for this host."""
    mine = {
        "GEODILOCO_COORDINATOR": coordinator,
        "GEODILOCO_NPROC": "1",
        "GEODILOCO_METRICS_HOST": "127.0.0.1",
        "GEODILOCO_METRICS_PORT": str(free_port()),
        "GEODILOCO_PKI": str(pki),
    }
    lines = []
    for line in (SYSTEMD / "site.env.example").read_text().splitlines():
        key = line.partition("=")[0]
        lines.append(f"{key}={mine[key]}" if key in mine else line)
    # over the unit's Environment= default (every 10 rounds), so that this short run writes some
    lines.append("GEODILOCO_CHECKPOINT_EVERY=1")
    return "\n".join(lines) + "\n"


def test_the_site_unit_runs_and_checkpoints_where_it_may_write(tmp_path: Path) -> None:
    unit, roots = (
        Unit.read("geodiloco-site@.service"),
        Roots(str(tmp_path / "var/lib"), str(tmp_path / "cache")),
    )
    cfg = tiny_config(sites=[SITE], rounds=3)
    pki = PkiDir(tmp_path / "pki")
    pki.init()
    pki.issue_site(SITE)
    security = ServerSecurity(
        tls=pki.issue_coordinator(["127.0.0.1", "localhost"]),
        keyring=Keyring(load_secret(pki.run_secret), cfg.run_id),
    )
    for state in unit.state_directories(SITE, roots):  # what systemd makes before ExecStart
        Path(state).mkdir(parents=True)
    with CoordinatorThread(cfg, security=security) as coordinator:
        env = unit.environment(env_file(pki.path, coordinator.target), SITE, roots)
        argv = unit.exec_start(env, SITE, roots)
        assert argv[0] == EXECUTABLE
        argv[0] = str(Path(sys.executable).with_name("geodiloco"))
        writable = unit.writable(SITE, roots)
        problem = sandbox_problem()
        if problem is None:
            argv = sandboxed(argv, tmp_path, writable)
        else:
            warnings.warn(f"no sandbox ({problem}): the unit's command ran unconfined", stacklevel=1)
        log = tmp_path / "site.log"
        with open(log, "wb") as out:
            site = subprocess.Popen(argv, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)
        try:
            assert site.wait(timeout=240) == 0, log.read_text()[-3000:]
        finally:
            if site.poll() is None:
                kill_tree(site)
        assert coordinator.controller.finished

    checkpoints = Path(env["GEODILOCO_CHECKPOINT_DIR"])
    assert env["GEODILOCO_CHECKPOINT_DIR"] == f"{env['STATE_DIRECTORY']}/checkpoints"
    assert any(checkpoints.is_relative_to(w) for w in writable), (checkpoints, writable)
    saved = sorted(checkpoints.glob("round-*/site.json"))
    assert len(saved) == 2, f"no checkpoint in {checkpoints}: {log.read_text()[-3000:]}"

    if problem is None:  # the sandbox is real: outside the writable paths nothing is written
        outside = tmp_path / "pki" / "written-by-the-site"
        probe = subprocess.run(
            sandboxed(["touch", str(outside)], tmp_path, writable), capture_output=True, text=True
        )
        assert probe.returncode != 0 and "Read-only file system" in probe.stderr, probe
        assert not outside.exists()
