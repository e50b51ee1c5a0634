"""Thin gRPC servicers: decode, validate the wire, delegate to the round controllers.

A run of ``outer.fragments`` P keeps one round controller per fragment
(:class:`~geodiloco.coordinator.fragment_rounds.FragmentedController`): pushes, pulls and reports are
routed by the fragment they name (an untrusted count, refused with INVALID_ARGUMENT unless
0 <= fragment < P, before anything else of the request is read); joins, heartbeats and leaves
reach every fragment. The last fragment settles the data ledger and speaks for the run in Join's
old fields, the status and the metrics, so with P = 1 nothing differs from a single controller.

Every refusal is a gRPC status with a message and one log line; nothing a request carries can
change the run's state unless the whole request is valid. With mTLS, a site acts only as the site
its certificate names, and chunk payloads are opened (and update payloads sealed) with the
site's keys (:mod:`geodiloco.security`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeVar

import grpc
from google.protobuf.message import Message

from geodiloco.coordinator.fragment_rounds import FragmentedController
from geodiloco.coordinator.intake import Pushes, PushOutcome
from geodiloco.coordinator.journal import Journal
from geodiloco.coordinator.refusals import (
    REFUSALS,
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    refusal_code,
)
from geodiloco.coordinator.round_metrics import CoordinatorMetrics
from geodiloco.coordinator.rounds import RoundController, SiteRecord
from geodiloco.coordinator.site_calls import JoinCall, PullCall, ReportCall, SiteCalls
from geodiloco.exchange import PullShare
from geodiloco.security.chunks import sealed_update_payload
from geodiloco.security.policy import Denied, ServerSecurity, is_admin, peer_identity, require_site
from geodiloco.security.ratelimit import RateLimiter
from geodiloco.security.raw_requests import encode_with, wire_size
from geodiloco.security.sealing import Sealer
from geodiloco.v1 import admin_pb2, admin_pb2_grpc, outer_sync_pb2, outer_sync_pb2_grpc
from geodiloco.wire import PUSHER_KEY, join_info_to_proto, report_from_proto, served_messages

log = logging.getLogger("geodiloco.coordinator")

R = TypeVar("R", bound=Message)


class Measured(Protocol):
    def ByteSize(self) -> int: ...


class SiteRequest(Measured, Protocol):
    """What every unary request of a site carries (Join, Heartbeat, Report, Leave)."""

    @property
    def site(self) -> str: ...


def _status(exc: Exception) -> grpc.StatusCode:
    return grpc.StatusCode[refusal_code(exc)]


async def _abort(context: grpc.aio.ServicerContext, rpc: str, site: str, exc: Exception) -> None:
    code = _status(exc)
    log.warning(
        "[OuterSync.%s] site=%s peer=%s refused (%s): %s", rpc, site or "?", context.peer(), code.name, exc
    )
    await context.abort(code, str(exc))


async def _next_chunk(
    chunks: AsyncIterator[outer_sync_pb2.DeltaChunk], timeout_s: float
) -> outer_sync_pb2.DeltaChunk | None:
    """The next message of a push, or None at its end; a stalled stream is abandoned."""
    try:
        return await asyncio.wait_for(anext(chunks), timeout_s)
    except StopAsyncIteration:
        return None
    except asyncio.TimeoutError:
        raise DeadlineExceeded(
            f"no chunk for {timeout_s:.0f}s (limits.chunk_timeout_s); push abandoned"
        ) from None


def _sealed(sealer: Sealer, head: outer_sync_pb2.UpdateChunk, payload: bytes | memoryview) -> bytes:
    """``head`` with ``payload`` sealed for its receiver, encoded (a worker thread)."""
    return encode_with(head, sealed_update_payload(sealer, head, payload))


class OuterSyncServicer(outer_sync_pb2_grpc.OuterSyncServicer):
    def __init__(
        self,
        controller: RoundController,
        security: ServerSecurity,
        metrics: CoordinatorMetrics | None = None,
        journal: Journal | None = None,
        fragments: FragmentedController | None = None,
    ) -> None:
        """``fragments``: the run's fragment controllers when P > 1 (``controller`` is their
        primary); by default the run is ``controller``'s one fragment."""
        self.run = fragments or FragmentedController.single(controller)
        self.c = self.run.primary
        self.security = security
        self.joins = RateLimiter(controller.cfg.limits.joins_per_minute)
        self.metrics = metrics or CoordinatorMetrics(self.c)
        self.journal = journal or Journal(None)
        self.pushes = Pushes(self.run, security.keyring, self.metrics, self.journal)
        self.calls = SiteCalls(self.run, security.keyring, self.pushes, self.journal)

    def _count(self, site: str, received: Measured | None = None, sent: Measured | None = None) -> None:
        self.c.count_bytes(
            site,
            received=received.ByteSize() if received is not None else 0,
            sent=sent.ByteSize() if sent is not None else 0,
        )

    async def _unary(
        self,
        rpc: str,
        request: SiteRequest,
        context: grpc.aio.ServicerContext,
        handler: Callable[[], Awaitable[R]],
    ) -> R:
        try:
            require_site(self.security, context, request.site)
        except Denied as exc:
            self.c.count_bytes(None, received=request.ByteSize())
            await _abort(context, rpc, request.site, exc)
        self._count(request.site, received=request)
        try:
            response = await handler()
        except REFUSALS as exc:
            await _abort(context, rpc, request.site, exc)
        self._count(request.site, sent=response)
        return response

    def _check_join_rate(self, context: grpc.aio.ServicerContext) -> None:
        identity = peer_identity(context)
        peer = identity.uri if identity else context.peer().rpartition(":")[0]
        if not self.joins.allow(peer):
            limit = self.c.cfg.limits.joins_per_minute
            raise ResourceExhausted(f"too many joins from this peer (limits.joins_per_minute {limit})")

    async def Join(
        self, request: outer_sync_pb2.JoinRequest, context: grpc.aio.ServicerContext
    ) -> outer_sync_pb2.JoinResponse:
        async def handle() -> outer_sync_pb2.JoinResponse:
            self._check_join_rate(context)
            call = JoinCall(
                request.site, request.run_id, request.world_size, request.key_proof, request.version
            )
            return join_info_to_proto(await self.calls.join(call))

        return await self._unary("Join", request, context, handle)

    async def Heartbeat(
        self, request: outer_sync_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> outer_sync_pb2.HeartbeatResponse:
        async def handle() -> outer_sync_pb2.HeartbeatResponse:
            lease = self.calls.heartbeat(request.site, request.run_id)
            return outer_sync_pb2.HeartbeatResponse(
                round=lease.round, lease_s=lease.lease_s, finished=lease.finished
            )

        return await self._unary("Heartbeat", request, context, handle)

    async def Report(
        self, request: outer_sync_pb2.ReportRequest, context: grpc.aio.ServicerContext
    ) -> outer_sync_pb2.ReportResponse:
        async def handle() -> outer_sync_pb2.ReportResponse:
            call = ReportCall(request.site, request.run_id, report_from_proto(request))
            ok, expected = await self.calls.report(call)
            return outer_sync_pb2.ReportResponse(hash_ok=ok, expected_hash=expected)

        return await self._unary("Report", request, context, handle)

    async def Leave(
        self, request: outer_sync_pb2.LeaveRequest, context: grpc.aio.ServicerContext
    ) -> outer_sync_pb2.LeaveResponse:
        async def handle() -> outer_sync_pb2.LeaveResponse:
            await self.calls.leave(request.site, request.run_id, request.reason)
            return outer_sync_pb2.LeaveResponse()

        return await self._unary("Leave", request, context, handle)

    async def PushDelta(
        self, request_iterator: AsyncIterator[outer_sync_pb2.DeltaChunk], context: grpc.aio.ServicerContext
    ) -> outer_sync_pb2.PushAck:
        timeout_s = self.c.cfg.limits.chunk_timeout_s
        opener = self._pusher(context)
        site = ""

        async def chunks() -> AsyncIterator[outer_sync_pb2.DeltaChunk]:
            nonlocal site
            with self.run.transferring(opener):  # alive while its first chunk crosses a slow link
                chunk = await _next_chunk(request_iterator, timeout_s)
            if chunk is not None:
                site = chunk.header.site
                require_site(self.security, context, site)
            while chunk is not None:
                yield chunk
                chunk = await _next_chunk(request_iterator, timeout_s)

        def count(site: str, chunk: outer_sync_pb2.DeltaChunk) -> int:
            size = wire_size(request_iterator, chunk)
            self.c.count_bytes(site, received=size)
            return size

        try:
            receipt = await self.pushes.receive(opener, chunks(), count)
        except REFUSALS as exc:
            await _abort(context, "PushDelta", site, exc)
        ack = outer_sync_pb2.PushAck(
            round=receipt.round,
            fragment=receipt.fragment,
            duplicate=receipt.outcome is PushOutcome.DUPLICATE,
            payload_bytes=receipt.payload_bytes,
        )
        self._count(site, sent=ack)
        return ack

    def _pusher(self, context: grpc.aio.ServicerContext) -> str:
        """The site that opened a push stream, known before its first chunk: its certificate's
        name, or (plaintext loopback only) the ``geodiloco-site`` metadata; "" when unnamed."""
        if self.security.authenticates:
            identity = peer_identity(context)
            return identity.name if identity is not None and identity.role == "site" else ""
        named = [v for k, v in context.invocation_metadata() or () if k == PUSHER_KEY]
        return named[0] if named and isinstance(named[0], str) else ""

    async def PullUpdate(  # type: ignore[override]  # yields pre-encoded bytes (raw_requests)
        self, request: outer_sync_pb2.PullRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        requested = time.time()
        try:
            require_site(self.security, context, request.site)
            self._count(request.site, received=request)
            if request.kind not in (outer_sync_pb2.PullRequest.UPDATE, outer_sync_pb2.PullRequest.FULL_STATE):
                raise InvalidArgument("PullRequest.kind must be UPDATE or FULL_STATE")
            full_state = request.kind == outer_sync_pb2.PullRequest.FULL_STATE
            share = PullShare(request.fragment, request.round, full_state, request.part, request.parts)
            call = PullCall(request.site, request.run_id, share)
            served = await self.calls.pull(call)
        except REFUSALS as exc:
            await _abort(context, "PullUpdate", request.site, exc)
        keys = self.security.keyring.site(request.site) if self.security.keyring else None
        ready, sent = time.time(), 0
        with self.run.transferring(request.site):
            for head, payload in served_messages(self.c.cfg.run_id, call.site, call.share.fragment, served):
                if keys is not None:  # sealing a chunk is a pass over it: not on the event loop
                    message = await asyncio.to_thread(_sealed, keys.down, head, payload)
                else:
                    message = encode_with(head, payload)
                self.c.count_bytes(request.site, sent=len(message))
                sent += len(message)
                yield message
        self.calls.pulled(call, served, requested, ready, time.time(), sent)


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """Status for everyone with a certificate of the run's CA; details and Shutdown for admins."""

    def __init__(
        self,
        controller: RoundController,
        on_shutdown: Callable[[float], None],
        security: ServerSecurity,
        fragments: FragmentedController | None = None,
    ) -> None:
        self.c = controller
        self.on_shutdown = on_shutdown
        self.security = security
        self.fragments = fragments

    async def GetStatus(
        self, request: admin_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.StatusResponse:
        full = status_message(self.c, self.fragments)
        if is_admin(self.security, context):
            return full
        return admin_pb2.StatusResponse(
            run_id=full.run_id,
            round=full.round,
            rounds_total=full.rounds_total,
            finished=full.finished,
            phase=full.phase,
            num_params=full.num_params,
        )

    async def Shutdown(
        self, request: admin_pb2.ShutdownRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ShutdownResponse:
        if not is_admin(self.security, context):
            log.warning("[Admin.Shutdown] peer=%s refused (PERMISSION_DENIED): not an admin", context.peer())
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "Shutdown needs an admin certificate")
        if not math.isfinite(request.grace_s) or not 0 <= request.grace_s <= 3600:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "grace_s must be in [0, 3600]")
        log.info("[Admin.Shutdown] requested, grace %.1fs", request.grace_s)
        self.on_shutdown(request.grace_s)
        return admin_pb2.ShutdownResponse()


def status_message(
    c: RoundController, fragments: FragmentedController | None = None
) -> admin_pb2.StatusResponse:
    """The run's status from its (last fragment's) controller ``c``; with ``fragments``, a site's
    refused and late pushes are counted over every fragment, and its hash is ok only when its
    last report of every fragment matched."""
    now = time.monotonic()
    run = fragments or FragmentedController.single(c)

    def over_fragments(name: str) -> tuple[int, int, int, bool]:
        records = [f.sites[name] for f in run.fragments if name in f.sites]
        return (
            sum(r.rejected for r in records),
            sum(r.late for r in records),
            sum(r.late_merged for r in records),
            all(r.hash_ok for r in records),
        )

    sites = [_site_status(c, s, now, *over_fragments(s.name)) for s in c.sites.values()]
    history = [
        admin_pb2.RoundRecord(
            round=h.round,
            contributors=h.contributors,
            tokens=h.tokens,
            eval_loss=h.eval_loss,
            eval_count=h.eval_count,
            state_hash=h.state_hash,
            duration_s=h.duration_s,
            update_bytes=h.update_bytes,
            hashes_agree=h.hashes_agree,
            hash_reports=len(h.hash_reports),
        )
        for h in c.history
    ]
    return admin_pb2.StatusResponse(
        run_id=c.cfg.run_id,
        round=c.round,
        rounds_total=c.cfg.rounds,
        finished=c.finished,
        sites=sites,
        history=history,
        wan_bytes_in=sum(s.bytes_in for s in c.sites.values()),
        wan_bytes_out=sum(s.bytes_out for s in c.sites.values()),
        uptime_s=now - c.started,
        phase=c.phase,
        num_params=run.num_params,
        data_windows_consumed=c.ledger.progress()[0],
        data_windows_total=c.ledger.progress()[1],
        grace_window_s=c.grace.window_s,
        waited_for=[admin_pb2.Arrival(site=a.site, after_s=a.after_s) for a in c.grace.waited_for],
        waiting_for=c.waiting_for if not c.finished else [],
    )


def _site_status(
    c: RoundController, s: SiteRecord, now: float, rejected: int, late: int, late_merged: int, hash_ok: bool
) -> admin_pb2.SiteStatus:
    return admin_pb2.SiteStatus(
        site=s.name,
        state=s.state,
        last_round=s.last_round,
        lease_remaining_s=max(0.0, c.cfg.lease_s - (now - s.last_seen)) if s.state == "joined" else 0.0,
        eval_loss=s.eval_loss,
        train_loss=s.train_loss,
        tokens=s.tokens,
        bytes_in=s.bytes_in,
        bytes_out=s.bytes_out,
        accepted=s.accepted,
        rejected=rejected,
        late=late,
        late_merged=late_merged,
        hash_ok=hash_ok,
        last_report_round=s.last_report_round,
    )
