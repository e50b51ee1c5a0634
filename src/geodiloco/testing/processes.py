"""Start `geodiloco` as a real process, and kill one with everything below it.

Tests, benchmarks and the demo's tooling share these: a site is a launcher, torchrun and its
ranks, and torchrun starts each rank in a session of its own, so killing the launcher's process
group would leave the ranks training under the site's name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from geodiloco.app.status import fetch_status, request_shutdown
from geodiloco.config import RunConfig
from geodiloco.testing.audits import ledger_problems, round_log


def spawn_geodiloco(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """`geodiloco ARGS` in its own process group, output appended to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "geodiloco", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a process and every process below it, as if its machine died."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, parents first (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def start_coordinator_process(cfg: RunConfig, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`geodiloco coordinator serve` on a free loopback port; returns the process and its target."""
    (workdir / "run.json").write_text(cfg.to_json())
    port_file = workdir / "port"
    proc = spawn_geodiloco(
        [
            "coordinator",
            "serve",
            "--config",
            str(workdir / "run.json"),
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--run-dir",
            str(workdir / "coord"),
            "--insecure",
        ],
        workdir / "coordinator.log",
    )
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError((workdir / "coordinator.log").read_text()[-3000:])
        time.sleep(0.1)
    return proc, f"127.0.0.1:{port_file.read_text()}"


def site_args(name: str, target: str, *extra: str) -> list[str]:
    """`geodiloco site run` arguments of a plaintext loopback site on the CPU."""
    return ["site", "run", "--name", name, "--coordinator", target, "--insecure", "--device", "cpu", *extra]


class SitesRun:
    """A coordinator process and `geodiloco site run` processes on loopback: the set-up of the
    integration tests. Each process logs to ``workdir/<key>.log``; on exit, whatever happened,
    every process still running is killed with its children (torchrun and the ranks)."""

    def __init__(self, cfg: RunConfig, workdir: Path) -> None:
        self.cfg, self.workdir = cfg, workdir
        self.coordinator, self.target = start_coordinator_process(cfg, workdir)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def log(self, key: str) -> Path:
        return self.workdir / f"{key}.log"

    def start(self, name: str, *extra: str, key: str = "") -> subprocess.Popen[bytes]:
        """Site ``name`` (``site_args`` and ``extra``), known here as ``key`` (default: its name)."""
        key = key or name
        self.procs[key] = spawn_geodiloco(site_args(name, self.target, *extra), self.log(key))
        return self.procs[key]

    def wait(self, *keys: str, timeout: float = 400) -> None:
        """Until these sites (all when none named) end; any that fails fails the test."""
        for key in keys or tuple(self.procs):
            assert self.procs[key].wait(timeout=timeout) == 0, self.log(key).read_text()[-3000:]

    def status(self) -> Any:
        return fetch_status(self.target, None)

    def finish(self) -> None:
        """Every data window consumed exactly once, then a graceful stop of the coordinator."""
        assert ledger_problems(round_log(self.workdir / "coord"), self.cfg) == []
        request_shutdown(self.target, None)
        assert self.coordinator.wait(timeout=30) == 0

    def __enter__(self) -> SitesRun:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in (*self.procs.values(), self.coordinator):
            if proc.poll() is None:
                kill_tree(proc)


def wait_for_checkpoint(
    ckpt: Path, round_: int, watched: dict[subprocess.Popen[bytes], Path], timeout_s: float = 300
) -> None:
    """Until a site's checkpoint of ``round_`` is in ``ckpt``; a watched site that ends first,
    or the timeout (the first log's tail), fails the test."""
    deadline = time.monotonic() + timeout_s
    first_log = next(iter(watched.values()))
    while not list(ckpt.glob(f"round-{round_:06d}-*/site.json")):
        assert time.monotonic() < deadline, first_log.read_text()[-3000:]
        for proc, log in watched.items():
            assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)


def serve_args(config: Path, port: int, run_dir: Path) -> list[str]:
    """`geodiloco` arguments for a plaintext loopback coordinator on a fixed port (restartable)."""
    return [
        "coordinator",
        "serve",
        "--config",
        str(config),
        "--port",
        str(port),
        "--run-dir",
        str(run_dir),
        "--insecure",
    ]
