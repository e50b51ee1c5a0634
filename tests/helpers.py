"""Shared test helpers: small run configs and an in-process coordinator on loopback."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from geodiloco.config import RunConfig
from geodiloco.coordinator.rounds import RoundController
from geodiloco.coordinator.server import RunningServer, initial_parameters, run_until_stopped, start_server
from geodiloco.security.policy import ServerSecurity

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


PLAINTEXT = ServerSecurity(tls=None, keyring=None)


class CoordinatorThread:
    """A real grpc.aio coordinator server running in a background thread's event loop.

    Plaintext on loopback unless ``security`` says otherwise (the security suite uses mTLS).
    """

    def __init__(
        self, cfg: RunConfig, initial: torch.Tensor | None = None, security: ServerSecurity = PLAINTEXT
    ) -> None:
        self.cfg = cfg
        self.security = security
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
            controller = RoundController(self.cfg, self._initial)
            self.running = await start_server(controller, "127.0.0.1", 0, security=self.security, grace_s=0.5)
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
        self._thread.join(10)

    def __enter__(self) -> CoordinatorThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
