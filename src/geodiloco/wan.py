"""A loopback TCP proxy that emulates a wide-area link between a site and the coordinator.

Linux netem is not available everywhere (not in this project's CI kernel), so tests, benchmarks
and the demo put one of these in front of the coordinator per site: it adds one-way latency,
limits bandwidth, and on command partitions the link (bytes stop flowing both ways and are
delivered after the link heals, as TCP retransmission would) or resets every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("geodiloco.wan")

READ_BYTES = 64 * 1024


@dataclass(kw_only=True, slots=True)
class LinkConfig:
    """One direction's properties (applied to both directions)."""

    latency_ms: float = 0.0
    bandwidth_mbps: float = 0.0  # megabits per second; 0 means unlimited

    def __post_init__(self) -> None:
        if self.latency_ms < 0:
            raise ValueError(f"latency_ms must be >= 0, got {self.latency_ms}")
        if self.bandwidth_mbps < 0:
            raise ValueError(f"bandwidth_mbps must be >= 0, got {self.bandwidth_mbps}")


class WanProxy:
    """Forwards ``listen_port`` to ``target``; all methods run on the proxy's event loop."""

    def __init__(
        self, target_host: str, target_port: int, link: LinkConfig, listen_host: str = "127.0.0.1"
    ) -> None:
        self.target = (target_host, target_port)
        self.link = link
        self.listen_host = listen_host
        self.port = 0
        self.bytes_forwarded = 0
        self._server: asyncio.base_events.Server | None = None
        self._healed = asyncio.Event()
        self._healed.set()
        self._connections: set[asyncio.StreamWriter] = set()

    async def start(self, port: int = 0) -> int:
        self._server = await asyncio.start_server(self._accept, self.listen_host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        self.reset()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    @property
    def partitioned(self) -> bool:
        return not self._healed.is_set()

    def partition(self) -> None:
        log.info("link to %s:%d partitioned", *self.target)
        self._healed.clear()

    def heal(self) -> None:
        log.info("link to %s:%d healed", *self.target)
        self._healed.set()

    def reset(self) -> None:
        """Abort every open connection, as a middlebox sending RST would."""
        for writer in list(self._connections):
            transport = writer.transport
            if transport is not None:
                transport.abort()
        self._connections.clear()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.transport.abort()
            return
        self._connections.update((client_writer, server_writer))
        pumps = [
            asyncio.create_task(self._pump(client_reader, server_writer)),
            asyncio.create_task(self._pump(server_reader, client_writer)),
        ]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass  # the proxy is closing; end normally (asyncio's stream callback chokes on a cancelled task)
        finally:
            for task in pumps:
                task.cancel()
            for writer in (client_writer, server_writer):
                self._connections.discard(writer)
                writer.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read, and hand each piece to a writer task that delivers it after the latency."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        delivery = asyncio.create_task(self._deliver(queue, writer))
        try:
            while data := await reader.read(READ_BYTES):
                queue.put_nowait((time.monotonic() + self.link.latency_ms / 1000, data))
        except (ConnectionError, OSError):
            pass
        finally:
            if not delivery.done():  # let what was read reach the other side, briefly
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(queue.join(), timeout=5)
            delivery.cancel()

    async def _deliver(self, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter) -> None:
        rate = self.link.bandwidth_mbps * 1e6 / 8  # bytes per second
        try:
            while True:
                due, data = await queue.get()
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                await self._healed.wait()
                if rate:
                    await asyncio.sleep(len(data) / rate)  # serialisation delay of the bottleneck link
                writer.write(data)
                await writer.drain()
                self.bytes_forwarded += len(data)
                queue.task_done()
        except (ConnectionError, OSError):
            return  # the other side is gone; the pump notices on its own


class ProxyThread:
    """A :class:`WanProxy` on its own event loop in a background thread (for blocking callers)."""

    def __init__(self, target: str, link: LinkConfig | None = None, port: int = 0) -> None:
        host, _, target_port = target.rpartition(":")
        self.loop = asyncio.new_event_loop()
        self.proxy = WanProxy(host, int(target_port), link or LinkConfig())
        self._thread = threading.Thread(target=self.loop.run_forever, name="wan-proxy", daemon=True)
        self._thread.start()
        self._run(self.proxy.start(port))

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def _call(self, fn: Any) -> None:
        self.loop.call_soon_threadsafe(fn)

    @property
    def address(self) -> str:
        return f"{self.proxy.listen_host}:{self.proxy.port}"

    def partition(self) -> None:
        self._call(self.proxy.partition)

    def heal(self) -> None:
        self._call(self.proxy.heal)

    def reset(self) -> None:
        self._call(self.proxy.reset)

    def close(self) -> None:
        self._run(self._shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    async def _shutdown(self) -> None:
        await self.proxy.stop()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> ProxyThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
