from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import start_coordinator_process, tiny_config

SUBCOMMANDS = [
    [],
    ["coordinator"],
    ["coordinator", "serve"],
    ["site"],
    ["site", "run"],
    ["status"],
    ["demo"],
    ["baseline"],
]


def geodiloco(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "geodiloco", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("args", SUBCOMMANDS, ids=lambda a: " ".join(a) or "geodiloco")
def test_every_subcommand_has_help(args: list[str]) -> None:
    result = geodiloco(*args, "--help")
    assert result.returncode == 0
    assert "usage: geodiloco" in result.stdout


def test_bad_config_value_is_a_clear_message() -> None:
    result = geodiloco("demo", "--set", "outer.optimizer=adam")
    assert result.returncode == 2
    assert "outer.optimizer: unknown value 'adam'; accepted: nesterov, fedavg" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_flag_value_names_the_flag() -> None:
    result = geodiloco("site", "run", "--name", "x", "--nproc", "0")
    assert result.returncode == 2
    assert "--nproc" in result.stderr


def test_status_without_a_coordinator_is_a_clear_message() -> None:
    result = geodiloco("status", "--coordinator", "127.0.0.1:1", "--insecure")
    assert result.returncode == 2
    assert "cannot reach 127.0.0.1:1" in result.stderr


@pytest.mark.integration
def test_second_coordinator_on_a_busy_port_is_refused(tmp_path: Path) -> None:
    first, target = start_coordinator_process(tiny_config(), tmp_path)
    try:
        port = target.rsplit(":", 1)[1]
        second = geodiloco("coordinator", "serve", "--port", port, "--insecure")
        assert second.returncode == 2
        assert f"cannot listen on 127.0.0.1:{port}" in second.stderr
        status = geodiloco("status", "--coordinator", target, "--json", "--insecure")
        assert status.returncode == 0
        data = json.loads(status.stdout)
        assert data["run_id"] == "test-run" and data["rounds_total"] == 3 and data["round"] == 0
        assert [s["last_round"] for s in data["sites"]] == [-1, -1]
        assert data["sites"][0]["eval_loss"] is None  # NaN before any report
        table = geodiloco("status", "--coordinator", target, "--insecure")
        assert "site-a" in table.stdout and "waiting_for_sites" in table.stdout
    finally:
        first.kill()
