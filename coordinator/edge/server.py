"""The coordinator process: a grpc.aio server around one round controller."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from geodiloco import logs
from geodiloco.builders import build_data, build_model, check_workload_sized
from geodiloco.config import RunConfig
from geodiloco.coordinator.arenas import limit_arenas
from geodiloco.coordinator.durable import STATE_FILE, STATE_LABEL
from geodiloco.coordinator.edge.service import AdminServicer, OuterSyncServicer
from geodiloco.coordinator.fragment_rounds import FragmentedController, open_fragments
from geodiloco.coordinator.journal import Journal
from geodiloco.coordinator.round_metrics import CoordinatorMetrics
from geodiloco.coordinator.rounds import RoundController
from geodiloco.coordinator.rundir import lock_run_dir
from geodiloco.coordinator.unbuffered import drop_read_ahead
from geodiloco.pages import keep_freed_pages
from geodiloco.params import flatten_parameters
from geodiloco.prometheus import MetricsServer, serve_metrics
from geodiloco.security.policy import ServerSecurity, is_loopback
from geodiloco.security.raw_requests import strict_service
from geodiloco.security.sealing import Keyring
from geodiloco.security.secrets import load_secret
from geodiloco.security.tls import TlsFiles
from geodiloco.v1 import admin_pb2, outer_sync_pb2

log = logging.getLogger("geodiloco.coordinator")

SERVER_OPTIONS = [
    # Pulls wait for a round to commit (minutes): keepalive pings keep idle WAN NATs and
    # proxies from dropping the stream, and let either side notice a dead peer.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.max_concurrent_streams", 256),
    # Without this, a second coordinator started on the same port would silently share it.
    ("grpc.so_reuseport", 0),
]
OUTER_SYNC = outer_sync_pb2.DESCRIPTOR.services_by_name["OuterSync"]
ADMIN = admin_pb2.DESCRIPTOR.services_by_name["Admin"]
SERVICE_NAMES = (OUTER_SYNC.full_name, ADMIN.full_name)
# How often leases and deadlines are checked: a lost site is noticed at most this late, and
# the healthy ones wait that much longer for the round to close without it. A tick walks the
# sites only, so it stays cheap at any model size.
TICK_S = 0.1


@dataclass(kw_only=True, slots=True)
class ServeOptions:
    """How the coordinator listens. mTLS and a run secret are required unless ``insecure``."""

    host: str = "127.0.0.1"
    port: int = 50051
    run_dir: Path | None = None
    port_file: Path | None = None
    exit_when_finished: bool = False
    grace_s: float = 5.0
    tls: TlsFiles | None = None
    run_secret: Path | None = None
    insecure: bool = False
    metrics_port: int | None = None  # Prometheus /metrics on ``host`` (0 picks a free port)
    health_port: int | None = None  # plaintext grpc.health.v1 only, for probes that cannot do mTLS
    started: float | None = None  # time.monotonic() when the process began (the CLI's import)

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port", "health_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name}: {value} is not a TCP port (0-65535)")
        if self.insecure:
            if not is_loopback(self.host):
                raise ValueError(
                    f"insecure: plaintext is refused on {self.host!r}; bind 127.0.0.1 or ::1, or use mTLS"
                )
            if self.tls is not None:
                raise ValueError("insecure: drop the TLS files or the --insecure flag, not both")
            return
        if self.tls is None:
            raise ValueError("tls: the coordinator needs --tls-cert, --tls-key and --tls-ca (or --insecure)")
        if self.run_secret is None:
            raise ValueError(
                "run_secret: the coordinator needs --run-secret to seal payloads (or --insecure)"
            )

    def security(self, run_id: str) -> ServerSecurity:
        keyring = Keyring(load_secret(self.run_secret), run_id) if self.run_secret else None
        return ServerSecurity(tls=self.tls, keyring=keyring)


def data_shard_sizes(cfg: RunConfig) -> list[int]:
    """Items per data shard, for the ledger, from the run's data builder (as the sites read it)."""
    return build_data(cfg).shard_sizes


def _checked_model(cfg: RunConfig) -> torch.nn.Module:
    """The run's model, once the workload's dry step passed (a fresh start of P > 1)."""
    model = build_model(cfg)
    check_workload_sized(cfg, sum(p.numel() for p in model.parameters()))
    return model


def initial_parameters(cfg: RunConfig) -> torch.Tensor:
    """θ_0 from the run's model builder and seed: the same values every site builds on its own."""
    return flatten_parameters(build_model(cfg))


@dataclass(slots=True)
class StartupClock:
    """Seconds spent in each phase of a coordinator's start. A restart must serve again within
    a few seconds (sites wait meanwhile), so the start logs where its time went."""

    last: float
    phases: list[tuple[str, float]] = field(default_factory=list)

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.phases.append((phase, now - self.last))
        self.last = now

    def summary(self) -> str:
        total = sum(seconds for _, seconds in self.phases)
        parts = ", ".join(f"{phase} {seconds:.2f}s" for phase, seconds in self.phases)
        return f"{total:.2f}s ({parts})"


class BindError(OSError):
    """The coordinator could not listen on its address."""


@dataclass(slots=True)
class RunningServer:
    """A started coordinator server and the pieces needed to stop it gracefully."""

    server: grpc.aio.Server
    health: health_aio.HealthServicer
    controller: RoundController
    port: int
    stop: asyncio.Event
    grace_s: float
    metrics: CoordinatorMetrics
    journal: Journal
    health_server: grpc.aio.Server | None = None
    health_port: int = 0
    fragments: FragmentedController | None = None  # a run of P > 1 fragments (controller: the last)

    def request_stop(self, grace_s: float | None = None) -> None:
        if grace_s is not None:
            self.grace_s = grace_s
        self.stop.set()

    async def shutdown(self) -> None:
        """NOT_SERVING first (probes and balancers stop sending work), then let a commit in
        progress become durable, then give open calls ``grace_s`` to finish."""
        await self.health.enter_graceful_shutdown()
        run = self.fragments or FragmentedController.single(self.controller)
        await run.settle()
        await run.checkpoint()  # the next start replays nothing
        log.info(
            "stopping: %d rounds committed%s; grace %.1fs for open calls",
            self.controller.round,
            " and durable" if self.controller.run_dir is not None else " (no --run-dir: not durable)",
            self.grace_s,
        )
        await self.server.stop(self.grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)
        await asyncio.to_thread(self.journal.close)  # every event of the run is on disk

    async def start_health_port(self, host: str, port: int) -> None:
        """A plaintext server with only the health service (Kubernetes gRPC probes speak no mTLS)."""
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        try:
            bound = server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:
            bound = 0
        if not bound:
            raise BindError(f"health: cannot listen on {host}:{port} (address in use or not available)")
        await server.start()
        self.health_server, self.health_port = server, bound


async def start_server(
    controller: RoundController,
    host: str,
    port: int,
    *,
    security: ServerSecurity,
    grace_s: float = 5.0,
    fragments: FragmentedController | None = None,
) -> RunningServer:
    """Build and start the grpc.aio server with OuterSync, Admin, health and reflection.
    ``fragments``: a run of P > 1 fragments, whose last one is ``controller``."""
    limit = controller.cfg.limits.max_message_bytes
    # A message over the limit is refused by gRPC (RESOURCE_EXHAUSTED) before it is buffered.
    options = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    server = grpc.aio.server(options=[*options, *SERVER_OPTIONS])
    running = RunningServer(
        server,
        health_aio.HealthServicer(),
        controller,
        0,
        asyncio.Event(),
        grace_s,
        CoordinatorMetrics(controller),
        Journal(controller.run_dir if fragments is None else fragments.run_dir),
        fragments=fragments,
    )
    admin = AdminServicer(controller, running.request_stop, security, fragments)
    outer_sync = OuterSyncServicer(controller, security, running.metrics, running.journal, fragments)
    server.add_generic_rpc_handlers(
        (
            strict_service(OUTER_SYNC, outer_sync),
            strict_service(ADMIN, admin),
        )
    )
    health_pb2_grpc.add_HealthServicer_to_server(running.health, server)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    try:
        running.port = security.port(server, f"{host}:{port}")
    except RuntimeError:
        running.port = 0
    if not running.port:
        raise BindError(f"cannot listen on {host}:{port} (address in use or not available)")
    await server.start()
    for name in ("", *SERVICE_NAMES):
        await running.health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return running


async def run_until_stopped(running: RunningServer, exit_when_finished: bool = False) -> None:
    """Drive leases and round deadlines until asked to stop (or the run is over)."""
    controller = running.controller
    while not running.stop.is_set():
        try:
            await asyncio.wait_for(running.stop.wait(), timeout=TICK_S)
        except asyncio.TimeoutError:
            await _tick(running)
            if exit_when_finished and controller.all_sites_done():
                log.info("run %s finished and every site has left; stopping", controller.cfg.run_id)
                running.stop.set()
    await running.shutdown()
    log.info("coordinator stopped at round %d", controller.round)


async def _tick(running: RunningServer) -> None:
    """One controller tick; sites whose lease ran out in it are counted and journaled."""
    controller = running.controller
    joined = [name for name, s in controller.sites.items() if s.state == "joined"]
    await (running.fragments or controller).tick()
    for name in joined:
        if controller.sites[name].state == "lost":
            running.metrics.lease_expiries.labels(site=name).inc()
            running.journal.write("lease_expired", site=name, round=controller.round)


def _resumes(run_dir: Path | None) -> bool:
    return run_dir is not None and (run_dir / STATE_FILE).exists()


async def serve(cfg: RunConfig, opts: ServeOptions) -> None:
    """The `geodiloco coordinator serve` process: serve until SIGINT/SIGTERM or Shutdown."""
    # Intake and commits run in worker threads; a short switch interval hands the GIL back to
    # the event loop sooner, so heartbeats and pulls are answered while they work.
    sys.setswitchinterval(0.001)
    limit_arenas()  # before the server's threads allocate: see coordinator/arenas.py
    keep_freed_pages()  # the same: see geodiloco/pages.py
    clock = StartupClock(time.monotonic())
    if opts.started is not None:
        clock.last = opts.started
        clock.mark("imports")
    # before anything in the run directory is read: one coordinator per run directory
    lock = lock_run_dir(opts.run_dir) if opts.run_dir is not None else None
    try:
        await _serve_locked(cfg, opts, clock)
    finally:
        if lock is not None:
            lock.release()


async def _serve_locked(cfg: RunConfig, opts: ServeOptions, clock: StartupClock) -> None:
    security = opts.security(cfg.run_id)
    sealer = security.keyring.at_rest(STATE_LABEL) if security.keyring else None  # state sealed at rest
    resumes = _resumes(opts.run_dir)
    # A resume builds neither the model nor the data: θ and the ledger (with its shard sizes)
    # come from the snapshot, so a restart costs the state's size, not the workload's.
    # A fresh start takes the workload's dry step once θ_0 is built (its size decides where the
    # step runs): a builder mismatch is a config error here, not in a site's rank. A resume was
    # checked when its run began.
    fragments = None
    if cfg.outer.fragments > 1:  # streaming: one round controller per fragment
        fragments = await open_fragments(
            cfg, opts.run_dir, sealer, lambda: data_shard_sizes(cfg), lambda: _checked_model(cfg)
        )
        controller = fragments.primary
        clock.mark("fragments")
    else:
        initial: torch.Tensor | None = None
        shard_sizes: list[int] | None = None
        if not resumes:
            initial, shard_sizes = initial_parameters(cfg), data_shard_sizes(cfg)
            clock.mark("model and data")
            check_workload_sized(cfg, initial.numel())
            clock.mark("dry step")
        controller = RoundController(cfg, initial, shard_sizes, opts.run_dir, sealer)
        del initial  # the controller holds its own θ: this copy would live as long as the server
        clock.mark("state and replay" if resumes else "controller")
    drop_read_ahead()  # a snapshot read ahead and not taken (a streaming run's are per fragment)
    if not resumes and fragments is None:
        await controller.checkpoint()  # θ_0 on disk: a restart reads it instead of rebuilding the model
        clock.mark("first snapshot")
    # Everything built so far lives as long as the process: out of the collector's sight, a full
    # collection no longer walks torch's hundreds of thousands of objects on the event loop.
    gc.freeze()
    logs.bind(run=cfg.run_id, round=lambda: controller.round)
    running = await start_server(
        controller, opts.host, opts.port, security=security, grace_s=opts.grace_s, fragments=fragments
    )
    clock.mark("server start")
    metrics: MetricsServer | None = None
    try:
        if opts.health_port is not None:
            await running.start_health_port(opts.host, opts.health_port)
            log.info("health (plaintext, grpc.health.v1 only) on %s:%d", opts.host, running.health_port)
        if opts.metrics_port is not None:
            try:
                metrics = serve_metrics(running.metrics.registry, opts.host, opts.metrics_port)
            except OSError as exc:
                raise BindError(str(exc)) from None
    except BindError:
        await running.server.stop(0)
        raise
    try:
        await _serve_until_stopped(cfg, opts, running, security, clock)
    finally:
        if metrics is not None:
            metrics.close()


async def _serve_until_stopped(
    cfg: RunConfig, opts: ServeOptions, running: RunningServer, security: ServerSecurity, clock: StartupClock
) -> None:
    controller = running.controller
    log.info("ready to serve at round %d after %s", controller.round, clock.summary())
    log.info(
        "coordinator for run %s serving on %s:%d, %s, payloads %s (%d parameters, sites: %s)",
        cfg.run_id,
        opts.host,
        running.port,
        "mTLS" if security.authenticates else "PLAINTEXT (loopback only)",
        "sealed" if security.keyring else "NOT sealed",
        controller.num_params,
        ", ".join(cfg.sites),
    )
    if opts.port_file is not None:
        tmp = opts.port_file.with_suffix(".tmp")
        tmp.write_text(str(running.port))
        tmp.replace(opts.port_file)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, running.request_stop)
    await run_until_stopped(running, opts.exit_when_finished)
