"""Shared test helpers: small run configs and an in-process coordinator on loopback."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import subprocess
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from torch import nn

from geodiloco.app.status import fetch_status, request_shutdown
from geodiloco.config import RunConfig
from geodiloco.coordinator.edge.server import (
    RunningServer,
    data_shard_sizes,
    initial_parameters,
    run_until_stopped,
    start_server,
)
from geodiloco.coordinator.ledger import ConsumedRecord, check_exactly_once
from geodiloco.coordinator.rounds import RoundController
from geodiloco.security.policy import ServerSecurity
from geodiloco.testing.processes import kill_tree as kill_tree  # re-exported for the tests
from geodiloco.testing.processes import spawn_geodiloco as spawn_geodiloco
from geodiloco.workload.data import DataRange

CUDA = pytest.param(  # a device parameter: runs where CUDA is, marked gpu, skipped elsewhere
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
)
DEVICES = ["cpu", CUDA]

T = TypeVar("T")


def tiny_config(**overrides: Any) -> RunConfig:
    """A run small enough for unit and integration tests (a few thousand parameters)."""
    data: dict[str, Any] = {
        "run_id": "test-run",
        "sites": ["site-a", "site-b"],
        "rounds": 3,
        "round_timeout_s": 30.0,
        "heartbeat_interval_s": 0.5,
        "lease_s": 5.0,
        "model": {"n_layer": 1, "n_head": 2, "d_model": 16, "seq_len": 16},
        "data": {"max_bytes": 300_000, "batch_size": 4, "eval_sequences": 16},
        "inner": {"steps_per_round": 3, "lr": 3e-3},
        "outer": {"optimizer": "nesterov", "lr": 0.7, "momentum": 0.5},
    }
    for key, value in overrides.items():
        node = data
        *parents, leaf = key.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return RunConfig.from_dict(data)


def streaming_config(fragments: int = 1, overlap: int = 0, **overrides: Any) -> RunConfig:
    """tiny_config with a streaming schedule: P fragments, τ steps of overlap, α = 0.5."""
    settings: dict[str, Any] = {
        "rounds": 3,
        "inner__steps_per_round": 4,
        "outer__fragments": fragments,
        "outer__overlap_steps": overlap,
        "outer__mix_alpha": 0.5,
        "lease_s": 30.0,
        **overrides,
    }
    return tiny_config(**settings)


def global_snapshot(sync: Any) -> torch.Tensor:
    """A site's copy of the global parameters (its OuterSync's snapshot), as one flat vector."""
    return torch.cat([t.reshape(-1) for t in sync.snapshot])


class Blocks(nn.Module):
    """Four numbered blocks and a head, the same values in every instance (θ_0): a model whose
    fragment plan has several layers to stride over."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 2)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))


PLAINTEXT = ServerSecurity(tls=None, keyring=None)


class CoordinatorThread:
    """A real grpc.aio coordinator server running in a background thread's event loop.

    Plaintext on loopback unless ``security`` says otherwise (the security suite uses mTLS).
    """

    def __init__(
        self,
        cfg: RunConfig,
        initial: torch.Tensor | None = None,
        security: ServerSecurity = PLAINTEXT,
        port: int = 0,
    ) -> None:
        self.cfg = cfg
        self.security = security
        self.port = port
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._initial = initial if initial is not None else initial_parameters(cfg)
        self.running: RunningServer | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("coordinator did not start")

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def run() -> None:
            controller = RoundController(self.cfg, self._initial, data_shard_sizes(self.cfg))
            self.running = await start_server(
                controller, "127.0.0.1", self.port, security=self.security, grace_s=0.5
            )
            self._ready.set()
            await run_until_stopped(self.running)

        self.loop.run_until_complete(run())

    @property
    def controller(self) -> RoundController:
        assert self.running is not None
        return self.running.controller

    @property
    def target(self) -> str:
        assert self.running is not None
        return f"127.0.0.1:{self.running.port}"

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        """Run a coroutine on the server's loop (the only safe way to touch its state)."""
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def stop(self) -> None:
        if self.running is not None:
            self.loop.call_soon_threadsafe(self.running.request_stop)
        # a loaded machine takes a while to settle and stop: never leak the server into the next test
        self._thread.join(60)

    def __enter__(self) -> CoordinatorThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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


def eval_losses(log: str) -> list[float]:
    """The eval slice losses a site's log reports, one per round; each must be finite."""
    losses = [
        float(line.rsplit("eval slice loss ", 1)[1]) for line in log.splitlines() if "eval slice loss" in line
    ]
    assert all(math.isfinite(v) for v in losses), losses
    return losses


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ledger_problems(round_log: list[dict[str, Any]], cfg: RunConfig) -> list[str]:
    """Audit a coordinator's round log: every data window consumed exactly once, no gaps."""
    records = [
        ConsumedRecord(entry["round"], site, DataRange(shard, start, end, epoch))
        for entry in round_log
        for site, shard, start, end, epoch in entry["data"]
    ]
    assert records, "the round log records no data"
    return check_exactly_once(records, data_shard_sizes(cfg))


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


def round_log(run_dir: Path) -> list[dict[str, Any]]:
    """The coordinator's committed rounds, as written to its run directory so far (a line still
    being written, without its newline, is left out)."""
    path = run_dir / "rounds.jsonl"
    complete = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line) for line in complete]
