"""The coordinator process: a grpc.aio server around one round controller."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from geodiloco.config import RunConfig
from geodiloco.coordinator.rounds import RoundController
from geodiloco.coordinator.service import AdminServicer, OuterSyncServicer
from geodiloco.params import flatten_parameters
from geodiloco.v1 import admin_pb2, admin_pb2_grpc, outer_sync_pb2, outer_sync_pb2_grpc
from geodiloco.workload.model import build_model

log = logging.getLogger("geodiloco.coordinator")

MAX_MESSAGE_BYTES = 32 * 1024 * 1024
SERVER_OPTIONS = [
    # Chunks are a few MiB; anything much larger is refused by gRPC before it reaches us.
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Pulls wait for a round to commit (minutes): keepalive pings keep idle WAN NATs and
    # proxies from dropping the stream, and let either side notice a dead peer.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.max_concurrent_streams", 256),
]
SERVICE_NAMES = (
    outer_sync_pb2.DESCRIPTOR.services_by_name["OuterSync"].full_name,
    admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
)
TICK_S = 0.5


@dataclass(kw_only=True, slots=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 50051
    run_dir: Path | None = None
    port_file: Path | None = None
    exit_when_finished: bool = False
    grace_s: float = 5.0


def initial_parameters(cfg: RunConfig):  # noqa: ANN201
    """θ_0 from the run's seed: the same values every site builds on its own."""
    return flatten_parameters(build_model(cfg.model, cfg.seed))


async def serve(cfg: RunConfig, opts: ServeOptions) -> None:
    controller = RoundController(cfg, initial_parameters(cfg), opts.run_dir)
    stop = asyncio.Event()
    grace = [opts.grace_s]

    def request_stop(grace_s: float = opts.grace_s) -> None:
        grace[0] = grace_s
        stop.set()

    server = grpc.aio.server(options=SERVER_OPTIONS)
    outer_sync_pb2_grpc.add_OuterSyncServicer_to_server(OuterSyncServicer(controller), server)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(controller, request_stop), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    port = server.add_insecure_port(f"{opts.host}:{opts.port}")
    await server.start()
    for name in ("", *SERVICE_NAMES):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "coordinator for run %s serving on %s:%d (%d parameters, sites: %s)",
        cfg.run_id, opts.host, port, controller.num_params, ", ".join(cfg.sites),
    )
    if opts.port_file is not None:
        tmp = opts.port_file.with_suffix(".tmp")
        tmp.write_text(str(port))
        tmp.replace(opts.port_file)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, request_stop)

    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=TICK_S)
        except asyncio.TimeoutError:
            await controller.tick()
            if opts.exit_when_finished and controller.all_sites_done():
                log.info("run %s finished and every site has left; stopping", cfg.run_id)
                stop.set()

    await health.enter_graceful_shutdown()
    await server.stop(grace[0])
    log.info("coordinator stopped at round %d", controller.round)
