"""A loopback TCP proxy that emulates a wide-area link between a site and the coordinator.

Linux netem is not available everywhere (not in this project's CI kernel), so tests, benchmarks,
the demo and operators (``geodiloco wan``) put one of these in front of the coordinator per site.

Each direction behaves like a bottleneck link with a bounded buffer: the sender is read only as
fast as the link transmits (so TCP and HTTP/2 flow control push back on it, as on a real WAN),
at most ``buffer_bytes`` are held between the two sockets, and every piece arrives one latency
later, plus optional jitter. Loss is emulated as TCP experiences it: the stream never loses
bytes, but a lost piece arrives one retransmission timeout late and holds up what follows. Bytes
the sender wrote but the link had not yet taken are lost with it when it dies, so a process
killed mid-push delivers at most the buffered bytes of that push, not the whole of it.

On command the link partitions (bytes stop both ways and flow again after it heals, as TCP
retransmission would deliver them), adds delay, or resets every connection; a small line-based
control port lets other processes give these commands (see :mod:`geodiloco.faults`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import signal
import socket
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("geodiloco.app.wan")

MAX_PIECE = 64 * 1024  # largest read from a socket at a time
MIN_PIECE = 1024
PIECE_SECONDS = 0.005  # at a limited rate, read pieces of about this much link time
SOCKET_BUFFER = 64 * 1024  # kernel buffer on the proxy's sockets (the kernel doubles it)
MIN_RTO_S = 0.2  # Linux's minimum retransmission timeout
MIN_BUFFER = 256 * 1024
UNLIMITED_BUFFER = 4 * 1024 * 1024


@dataclass(kw_only=True, slots=True)
class LinkConfig:
    """One direction's properties (the same in both directions)."""

    latency_ms: float = 0.0  # one way; the round-trip time is twice this
    bandwidth_mbps: float = 0.0  # megabits per second; 0 means unlimited
    jitter_ms: float = 0.0  # each piece's latency varies uniformly in ±jitter (order is kept)
    loss: float = 0.0  # chance that a piece is lost once: it arrives a retransmission timeout late
    buffer_bytes: int = 0  # most bytes held between the sockets per direction; 0: see `buffer`
    seed: int | None = None  # of the jitter and loss draws; None: a fresh one

    def __post_init__(self) -> None:
        if self.latency_ms < 0:
            raise ValueError(f"latency_ms must be >= 0, got {self.latency_ms}")
        if self.bandwidth_mbps < 0:
            raise ValueError(f"bandwidth_mbps must be >= 0, got {self.bandwidth_mbps}")
        if not 0 <= self.jitter_ms <= self.latency_ms:
            raise ValueError(f"jitter_ms must be in [0, latency_ms={self.latency_ms}], got {self.jitter_ms}")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")
        if self.buffer_bytes and self.buffer_bytes < MIN_PIECE:
            raise ValueError(f"buffer_bytes must be 0 (automatic) or >= {MIN_PIECE}, got {self.buffer_bytes}")

    @property
    def rate(self) -> float:
        """Bytes per second; 0 when unlimited."""
        return self.bandwidth_mbps * 1e6 / 8

    @property
    def buffer(self) -> int:
        """``buffer_bytes``, or by default twice what the link holds in flight (its bandwidth-delay
        product; at least 256 KiB), as a bottleneck router is sized; 4 MiB on an unlimited link."""
        if self.buffer_bytes:
            return self.buffer_bytes
        if not self.rate:
            return UNLIMITED_BUFFER
        in_flight = self.rate * (self.latency_ms + self.jitter_ms) / 1000
        return int(max(MIN_BUFFER, 2 * in_flight))

    @property
    def piece(self) -> int:
        """Bytes read at a time: small enough that the link's pacing stays smooth."""
        if not self.rate:
            return MAX_PIECE
        return int(max(MIN_PIECE, min(MAX_PIECE, self.rate * PIECE_SECONDS)))


class Direction:
    """One direction of one connection: a paced reader, a bounded queue, a timed writer."""

    def __init__(self, proxy: WanProxy, name: str) -> None:
        self.proxy = proxy
        self.name = name  # "up" (towards the coordinator) or "down"
        link = proxy.link
        self.queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(
            maxsize=max(1, link.buffer // link.piece)
        )
        self._link_free_at = 0.0  # when the link has finished sending what it took
        self._last_due = 0.0  # pieces arrive in order, as TCP delivers them

    def _due(self, sent_at: float) -> float:
        link, rng = self.proxy.link, self.proxy.rng
        delay = link.latency_ms + self.proxy.extra_delay_ms(sent_at)
        if link.jitter_ms:
            delay += rng.uniform(-link.jitter_ms, link.jitter_ms)
        if link.loss and rng.random() < link.loss:
            delay += 1000 * max(MIN_RTO_S, 4 * link.latency_ms / 1000)  # a timeout: max(200 ms, 2 RTT)
        self._last_due = max(self._last_due, sent_at + delay / 1000)
        return self._last_due

    async def pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Carry bytes from ``reader`` to ``writer`` until the sender closes or either end fails."""
        delivery = asyncio.create_task(self._deliver(writer))
        link = self.proxy.link
        try:
            while True:
                await self.proxy.healed.wait()  # a partitioned link takes nothing from the sender
                data = await reader.read(link.piece)
                if not data:
                    break
                now = time.monotonic()
                if link.rate:  # the link transmits the piece, and only then takes the next one
                    self._link_free_at = max(now, self._link_free_at) + len(data) / link.rate
                    await asyncio.sleep(self._link_free_at - now)
                    now = self._link_free_at
                await self.queue.put((self._due(now), data))  # blocks while the buffer is full
        except (ConnectionError, OSError):
            pass
        finally:
            if not delivery.done():  # what the link took is in flight: let it land, briefly
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.queue.join(), timeout=5)
            delivery.cancel()

    async def _deliver(self, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                due, data = await self.queue.get()
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                await self.proxy.healed.wait()
                writer.write(data)
                await writer.drain()
                self.proxy.count(self.name, len(data))
                self.queue.task_done()
        except (ConnectionError, OSError):
            return  # the other side is gone; the pump notices on its own


def _small_buffers(writer: asyncio.StreamWriter) -> None:
    """Bound what the kernel holds for the proxy, so the link (not a socket buffer) sets the pace."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)


class WanProxy:
    """Forwards ``listen_port`` to ``target``; all methods run on the proxy's event loop."""

    def __init__(
        self, target_host: str, target_port: int, link: LinkConfig, listen_host: str = "127.0.0.1"
    ) -> None:
        self.target = (target_host, target_port)
        self.link = link
        self.listen_host = listen_host
        self.port = 0
        self.control_port = 0
        self.bytes_up = 0  # towards the target (the coordinator)
        self.bytes_down = 0
        # bytes delivered both ways in each whole second of time.monotonic(): the link's rate
        # over time, whose peak a link must be sized for (benchmarks/wan.py)
        self.per_second: dict[int, int] = {}
        self.rng = random.Random(link.seed)
        self.healed = asyncio.Event()
        self.healed.set()
        self._delay: tuple[float, float] = (0.0, 0.0)  # (extra ms, until monotonic time)
        self._heal_later: asyncio.TimerHandle | None = None
        self._server: asyncio.base_events.Server | None = None
        self._control: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    @property
    def bytes_forwarded(self) -> int:
        return self.bytes_up + self.bytes_down

    @property
    def open_connections(self) -> int:
        return len(self._connections) // 2

    def count(self, direction: str, n: int) -> None:
        if direction == "up":
            self.bytes_up += n
        else:
            self.bytes_down += n
        second = int(time.monotonic())
        self.per_second[second] = self.per_second.get(second, 0) + n

    def rate_profile(self, start: float, end: float) -> list[int]:
        """Bytes delivered (both ways) in each whole second that lies between the monotonic times
        ``start`` and ``end``, idle seconds as 0 (partial seconds at either end are left out)."""
        counts = dict(self.per_second)  # a copy: the proxy's loop may still be adding to it
        return [counts.get(s, 0) for s in range(math.ceil(start), math.floor(end))]

    async def start(self, port: int = 0) -> int:
        self._server = await asyncio.start_server(self._accept, self.listen_host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def start_control(self, port: int = 0) -> int:
        """Listen for fault commands (one line each; see :meth:`command`) on loopback ``port``
        (never on another interface: whoever reaches it can cut the link)."""
        self._control = await asyncio.start_server(self._serve_control, "127.0.0.1", port)
        self.control_port = self._control.sockets[0].getsockname()[1]
        return self.control_port

    async def stop(self) -> None:
        self.reset()
        for server in (self._server, self._control):
            if server is not None:
                server.close()
                await server.wait_closed()

    @property
    def partitioned(self) -> bool:
        return not self.healed.is_set()

    def partition(self, seconds: float = 0.0) -> None:
        """Stop bytes both ways; heal after ``seconds`` (0: until :meth:`heal`)."""
        log.info("link to %s:%d partitioned%s", *self.target, f" for {seconds:g}s" if seconds else "")
        self.healed.clear()
        if self._heal_later is not None:
            self._heal_later.cancel()
        if seconds:
            self._heal_later = asyncio.get_running_loop().call_later(seconds, self.heal)

    def heal(self) -> None:
        log.info("link to %s:%d healed", *self.target)
        self.healed.set()

    def delay(self, extra_ms: float, seconds: float) -> None:
        """Add ``extra_ms`` of one-way latency to what is sent in the next ``seconds``."""
        log.info("link to %s:%d: +%gms for %gs", *self.target, extra_ms, seconds)
        self._delay = (extra_ms, time.monotonic() + seconds)

    def extra_delay_ms(self, now: float) -> float:
        extra, until = self._delay
        return extra if now < until else 0.0

    def reset(self) -> None:
        """Abort every open connection, as a middlebox sending RST would."""
        for writer in list(self._connections):
            transport = writer.transport
            if transport is not None:
                transport.abort()
        self._connections.clear()

    def command(self, line: str) -> str:
        """Apply one control command: ``partition [SECONDS]``, ``heal``, ``delay MS SECONDS``,
        ``drop`` (reset every connection). Returns ``ok`` or ``error: why``."""
        words = line.split()
        try:
            numbers = [float(w) for w in words[1:]]
        except ValueError:
            return f"error: expected numbers after {words[0]!r}, got {' '.join(words[1:])!r}"
        match words[:1], numbers:
            case ["partition"], [] | [_]:
                self.partition(*numbers)
            case ["heal"], []:
                self.heal()
            case ["delay"], [_, _]:
                self.delay(*numbers)
            case ["drop"], []:
                self.reset()
            case _:
                accepted = "partition [S], heal, delay MS S, drop"
                return f"error: unknown command {line.strip()!r}; accepted: {accepted}"
        return "ok"

    async def _serve_control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                writer.write((self.command(line.decode(errors="replace")) + "\n").encode())
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except OSError as exc:
            log.warning("cannot reach %s:%d: %s", *self.target, exc.strerror or exc)
            client_writer.transport.abort()
            return
        for writer in (client_writer, server_writer):
            _small_buffers(writer)
        self._connections.update((client_writer, server_writer))
        pumps = [
            asyncio.create_task(Direction(self, "up").pump(client_reader, server_writer)),
            asyncio.create_task(Direction(self, "down").pump(server_reader, client_writer)),
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


class ProxyThread:
    """A :class:`WanProxy` on its own event loop in a background thread (for blocking callers)."""

    def __init__(
        self, target: str, link: LinkConfig | None = None, port: int = 0, control_port: int | None = None
    ) -> None:
        host, _, target_port = target.rpartition(":")
        self.loop = asyncio.new_event_loop()
        self.proxy = WanProxy(host, int(target_port), link or LinkConfig())
        self._thread = threading.Thread(target=self.loop.run_forever, name="wan-proxy", daemon=True)
        self._thread.start()
        self._run(self.proxy.start(port))
        if control_port is not None:
            self._run(self.proxy.start_control(control_port))

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def _call(self, fn: Any, *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    @property
    def address(self) -> str:
        return f"{self.proxy.listen_host}:{self.proxy.port}"

    @property
    def control_address(self) -> str:
        return f"127.0.0.1:{self.proxy.control_port}"

    def partition(self, seconds: float = 0.0) -> None:
        self._call(self.proxy.partition, seconds)

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


async def serve(
    listen: tuple[str, int], upstream: tuple[str, int], link: LinkConfig, control_port: int | None = None
) -> None:
    """Run a proxy until SIGINT or SIGTERM (``geodiloco wan``); print where it listens, once ready."""
    proxy = WanProxy(*upstream, link, listen_host=listen[0])
    await proxy.start(listen[1])
    ready = f"listening on {listen[0]}:{proxy.port}, forwarding to {upstream[0]}:{upstream[1]}"
    if control_port is not None:
        await proxy.start_control(control_port)
        ready += f", fault commands on 127.0.0.1:{proxy.control_port}"
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"geodiloco wan: {ready}", flush=True)
    log.info("link: %s", link)
    try:
        await stop.wait()
    finally:
        await proxy.stop()
