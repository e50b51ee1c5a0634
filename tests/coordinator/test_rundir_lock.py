"""One coordinator per run directory: a second `coordinator serve` is refused before it reads or
writes anything there, and a lock left by a dead coordinator does not block the next one."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from geodiloco.testing.configs import tiny_config
from geodiloco.testing.processes import kill_tree, start_coordinator_process

pytestmark = pytest.mark.integration


def serve_again(workdir: Path) -> subprocess.CompletedProcess[str]:
    """A second `coordinator serve` on the first one's run directory, on another (free) port."""
    args = ["coordinator", "serve", "--config", str(workdir / "run.json"), "--port", "0"]
    args += ["--run-dir", str(workdir / "coord"), "--insecure"]
    return subprocess.run(
        [sys.executable, "-m", "geodiloco", *args], capture_output=True, text=True, timeout=120
    )


def snapshot_of(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file's size and modification time (what a second coordinator must not touch)."""
    return {
        str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in run_dir.rglob("*")
        if p.is_file()
    }


def test_second_coordinator_on_the_run_dir_is_refused_naming_the_holder(tmp_path: Path) -> None:
    first, _ = start_coordinator_process(tiny_config(), tmp_path)
    try:
        run_dir = tmp_path / "coord"
        before = snapshot_of(run_dir)
        second = serve_again(tmp_path)
        assert second.returncode == 2, second.stderr
        refusal = [line for line in second.stderr.splitlines() if "coordinator serve:" in line]
        assert len(refusal) == 1 and "Traceback" not in second.stderr, second.stderr
        assert f"in use by another coordinator (pid {first.pid} on host {socket.gethostname()}" in refusal[0]
        assert snapshot_of(run_dir) == before  # nothing read into a split run, nothing written
        assert first.poll() is None
    finally:
        kill_tree(first)


def test_lock_of_a_killed_coordinator_does_not_block_the_next(tmp_path: Path) -> None:
    first, _ = start_coordinator_process(tiny_config(), tmp_path)
    os.kill(first.pid, signal.SIGKILL)
    first.wait(30)
    assert (tmp_path / "coord" / "coordinator.lock").exists()  # the stale file stays
    (tmp_path / "port").unlink()
    second, _ = start_coordinator_process(tiny_config(), tmp_path)
    try:
        assert second.poll() is None
        assert f'"pid": {second.pid}' in (tmp_path / "coord" / "coordinator.lock").read_text()
    finally:
        kill_tree(second)
