"""An in-process gRPC coordinator on loopback, for tests that need a real server but not a
process of its own."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from geodiloco.config import RunConfig
from geodiloco.coordinator.edge.server import (
    RunningServer,
    data_shard_sizes,
    initial_parameters,
    run_until_stopped,
    start_server,
)
from geodiloco.coordinator.rounds import RoundController
from geodiloco.security.policy import ServerSecurity
from geodiloco.testing.ports import free_port as free_port

T = TypeVar("T")

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
