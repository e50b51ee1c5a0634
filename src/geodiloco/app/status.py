"""`geodiloco status`: what the coordinator says about the run, as a table or JSON."""

from __future__ import annotations

import math
from typing import Any

from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from geodiloco.security.tls import TlsFiles, open_channel
from geodiloco.v1 import admin_pb2, admin_pb2_grpc

# what the coordinator tells a non-admin certificate (coordinator.service.AdminServicer.GetStatus)
SITE_VISIBLE = ("run_id", "round", "rounds_total", "finished", "phase", "num_params")
ADMIN_NEEDED = (
    "per-site state, losses, bytes, round history, uptime and the data ledger need an admin "
    "certificate (geodiloco certs issue --admin NAME)"
)


def fetch_status(target: str, tls: TlsFiles | None, timeout_s: float = 10.0) -> Any:
    """The run's status; per-site details and history need an admin certificate."""
    with open_channel(target, tls) as channel:
        return admin_pb2_grpc.AdminStub(channel).GetStatus(admin_pb2.StatusRequest(), timeout=timeout_s)


def request_shutdown(
    target: str, tls: TlsFiles | None, grace_s: float = 2.0, timeout_s: float = 10.0
) -> None:
    with open_channel(target, tls) as channel:
        admin_pb2_grpc.AdminStub(channel).Shutdown(
            admin_pb2.ShutdownRequest(grace_s=grace_s), timeout=timeout_s
        )


def check_health(target: str, tls: TlsFiles | None, service: str = "", timeout_s: float = 5.0) -> str:
    """grpc.health.v1 Check: SERVING, NOT_SERVING, SERVICE_UNKNOWN... (raises grpc.RpcError)."""
    with open_channel(target, tls) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
        )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


def visible_dict(status: Any, viewer: str | None = None) -> dict[str, Any]:
    """The JSON of ``geodiloco status``. ``viewer`` None: an admin (or a plaintext loopback
    run), who sees everything; else the non-admin certificate (e.g. "site site-a"), which is
    told only what it may see and which certificate the rest needs, not zeros that look like facts."""
    if viewer is None:
        return status_dict(status)
    out = {name: getattr(status, name) for name in SITE_VISIBLE}
    out.update(view=viewer, details=ADMIN_NEEDED)
    return out


def status_dict(message: Message) -> dict[str, Any]:
    """Plain JSON types (protobuf's JSON mapping would print 64-bit integers as strings)."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None:
            value = [status_dict(v) for v in value] if field.is_repeated else status_dict(value)
        elif field.is_repeated:
            value = list(value)
        elif isinstance(value, float) and not math.isfinite(value):
            value = None
        out[field.name] = value
    return out


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _loss(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.4f}"


def grace_line(status: Any) -> str:
    """The open round's grace window, whom it waits for, and whom the last round waited for."""
    waited = ", ".join(f"{a.site} (+{a.after_s:.1f}s)" for a in status.waited_for) or "nobody"
    waiting = f"; waiting for {', '.join(status.waiting_for)}" if status.waiting_for else ""
    return (
        f"grace window: {status.grace_window_s:.1f}s after a round's first contribution{waiting}; "
        f"the last round waited for {waited} after its quorum"
    )


def format_status(status: Any, viewer: str | None = None) -> str:
    """A table for an admin (``viewer`` None); for another certificate, what it may see."""
    if viewer is not None:
        return (
            f"run {status.run_id}: round {status.round}/{status.rounds_total} ({status.phase}), "
            f"{status.num_params:,} parameters\n"
            f"this certificate ({viewer}) may see only the run's round, phase and size; {ADMIN_NEEDED}"
        )
    last = status.history[-1] if status.history else None
    lines = [
        f"run {status.run_id}: round {status.round}/{status.rounds_total} ({status.phase}), "
        f"{status.num_params:,} parameters, up {status.uptime_s:.0f}s",
        f"WAN bytes: {human_bytes(status.wan_bytes_in)} in, {human_bytes(status.wan_bytes_out)} out"
        + (f"; last eval loss {_loss(last.eval_loss)} (round {last.round})" if last else ""),
        f"data ledger: {status.data_windows_consumed:,} of {status.data_windows_total:,} windows consumed",
        grace_line(status),
        "",
        f"{'site':<14}{'state':<9}{'round':>6}{'lease':>8}{'eval':>9}{'train':>9}"
        f"{'in':>11}{'out':>11}{'ok':>5}{'late':>5}{'mrgd':>5}{'rej':>5}{'hash':>6}",
    ]
    for s in status.sites:
        lease = f"{s.lease_remaining_s:.1f}s" if s.state == "joined" else "-"
        last_round = str(s.last_round) if s.last_round >= 0 else "-"
        lines.append(
            f"{s.site:<14}{s.state:<9}{last_round:>6}{lease:>8}{_loss(s.eval_loss):>9}"
            f"{_loss(s.train_loss):>9}{human_bytes(s.bytes_in):>11}{human_bytes(s.bytes_out):>11}"
            f"{s.accepted:>5}{s.late:>5}{s.late_merged:>5}{s.rejected:>5}{'ok' if s.hash_ok else 'BAD':>6}"
        )
    return "\n".join(lines)
