from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from geodiloco.testing.configs import tiny_config
from geodiloco.testing.processes import start_coordinator_process
from geodiloco.testing.servers import CoordinatorThread

SUBCOMMANDS = [
    [],
    ["coordinator"],
    ["coordinator", "serve"],
    ["site"],
    ["site", "run"],
    ["status"],
    ["report"],
    ["export"],
    ["health"],
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


def test_report_on_a_folder_that_is_no_run_is_a_clear_message(tmp_path: Path) -> None:
    result = geodiloco("report", str(tmp_path))
    assert result.returncode == 2
    assert f"geodiloco report: {tmp_path}: no rounds.jsonl here or in {tmp_path}/coordinator" in result.stderr
    (tmp_path / "rounds.jsonl").write_text('{"round": 0, "contributors": []}\nnot json\n')
    result = geodiloco("report", str(tmp_path))
    assert result.returncode == 2 and f"{tmp_path}/rounds.jsonl:2: not JSON" in result.stderr


def test_bad_ports_and_log_formats_name_the_flag() -> None:
    result = geodiloco("coordinator", "serve", "--insecure", "--metrics-port", "70000")
    assert result.returncode == 2
    assert "argument --metrics-port: expected a TCP port (0-65535), got 70000" in result.stderr
    result = geodiloco("status", "--log-format", "yaml")
    assert result.returncode == 2 and "argument --log-format: invalid choice: 'yaml'" in result.stderr


@pytest.mark.integration
def test_metrics_port_in_use_is_refused_before_serving(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = geodiloco("coordinator", "serve", "--insecure", "--port", "0", "--metrics-port", str(port))
        site = geodiloco("site", "run", "--name", "x", "--insecure", "--metrics-port", str(port))
    assert result.returncode == 2
    assert f"metrics: cannot listen on 127.0.0.1:{port}" in result.stderr
    assert site.returncode == 2
    assert f"geodiloco site: --metrics-port: cannot listen on 127.0.0.1:{port}" in site.stderr


@pytest.mark.integration
def test_health_says_serving_or_why_not() -> None:
    with CoordinatorThread(tiny_config()) as coordinator:
        serving = geodiloco("health", "--target", coordinator.target)
        unknown = geodiloco("health", "--target", coordinator.target, "--service", "no.Such")
    assert serving.returncode == 0 and serving.stderr == ""
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr
    down = geodiloco("health", "--target", "127.0.0.1:1")
    assert down.returncode == 1 and "geodiloco health: 127.0.0.1:1: UNAVAILABLE" in down.stderr


def test_status_connects_without_loading_the_training_stack() -> None:
    """`geodiloco status` spent ~7 s (20 s on a loaded machine) importing torch before it
    dialled: every command imported the config module to catch its errors (issue 16 item 8)."""
    with CoordinatorThread(tiny_config()) as c:
        script = (
            "import sys\nfrom geodiloco.app import cli\n"
            f"code = cli.main(['status', '--coordinator', {c.target!r}, '--insecure', '--json'])\n"
            "print('torch loaded' if 'torch' in sys.modules else 'torch not loaded', file=sys.stderr)\n"
            "sys.exit(code)\n"
        )
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["run_id"] == "test-run"
    assert "torch not loaded" in done.stderr
