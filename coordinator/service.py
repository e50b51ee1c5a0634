"""Thin gRPC servicers: decode, validate the wire, delegate to the round controller.

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
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import Message

from geodiloco import __version__
from geodiloco.compression import CodecError, EncodedChunk, Place
from geodiloco.coordinator.assembly import Assembly, check_declared, check_segment
from geodiloco.coordinator.errors import (
    CoordinatorError,
    DeadlineExceeded,
    InvalidArgument,
    LateContribution,
    ResourceExhausted,
)
from geodiloco.coordinator.journal import Journal
from geodiloco.coordinator.metrics import CoordinatorMetrics
from geodiloco.coordinator.rounds import RoundController
from geodiloco.security.chunks import KeyMismatch, open_delta, seal_update
from geodiloco.security.policy import Denied, ServerSecurity, is_admin, peer_identity, require_site
from geodiloco.security.ratelimit import RateLimiter
from geodiloco.security.sealing import SealError
from geodiloco.security.wire import MalformedRequest
from geodiloco.segment import Segment, segment_of
from geodiloco.v1 import admin_pb2, admin_pb2_grpc, outer_sync_pb2, outer_sync_pb2_grpc
from geodiloco.wire import ranges_from_proto, ranges_to_proto

log = logging.getLogger("geodiloco.coordinator")


def _finite_or_zero(x: float) -> float:
    return x if math.isfinite(x) else 0.0


REFUSALS = (CoordinatorError, CodecError, SealError, MalformedRequest, Denied)


def _status(exc: Exception) -> grpc.StatusCode:
    if isinstance(exc, CoordinatorError):
        return exc.code
    if isinstance(exc, Denied):
        return grpc.StatusCode.PERMISSION_DENIED
    if isinstance(exc, KeyMismatch):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INVALID_ARGUMENT  # corrupt, undecodable or tampered input


async def _abort(context: grpc.aio.ServicerContext, rpc: str, site: str, exc: Exception) -> None:
    code = _status(exc)
    log.warning(
        "[OuterSync.%s] site=%s peer=%s refused (%s): %s", rpc, site or "?", context.peer(), code.name, exc
    )
    await context.abort(code, str(exc))


def _segment(chunk: Any, seq: int) -> Segment:
    try:
        return segment_of(chunk.header)
    except ValueError as exc:
        raise InvalidArgument(f"chunk {seq}: {exc}") from None


async def _next_chunk(chunks: AsyncIterator[Any], timeout_s: float) -> Any:
    """The next message of a push, or None at its end; a stalled stream is abandoned."""
    try:
        return await asyncio.wait_for(anext(chunks), timeout_s)
    except StopAsyncIteration:
        return None
    except asyncio.TimeoutError:
        raise DeadlineExceeded(
            f"no chunk for {timeout_s:.0f}s (limits.chunk_timeout_s); push abandoned"
        ) from None


class OuterSyncServicer(outer_sync_pb2_grpc.OuterSyncServicer):
    def __init__(
        self,
        controller: RoundController,
        security: ServerSecurity,
        metrics: CoordinatorMetrics | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.c = controller
        self.security = security
        self.joins = RateLimiter(controller.cfg.limits.joins_per_minute)
        self.assemblies: dict[tuple[str, int], Assembly] = {}  # (site, round) -> parts so far
        self.metrics = metrics or CoordinatorMetrics(controller)
        self.journal = journal or Journal(None)

    def _count(self, site: str, received: Message | None = None, sent: Message | None = None) -> None:
        self.c.count_bytes(
            site,
            received=received.ByteSize() if received is not None else 0,
            sent=sent.ByteSize() if sent is not None else 0,
        )

    async def _unary(
        self,
        rpc: str,
        request: Any,
        context: grpc.aio.ServicerContext,
        handler: Callable[[], Any],
    ) -> Any:
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

    async def Join(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def handle() -> Any:
            self._check_join_rate(context)
            record = await self.c.join(request.site, request.run_id, request.world_size)
            if request.version and request.version != __version__:
                log.warning(
                    "site %s runs geodiloco %s, coordinator %s", request.site, request.version, __version__
                )
            return outer_sync_pb2.JoinResponse(
                run_id=self.c.cfg.run_id,
                run_config_json=self.c.cfg.to_json(),
                round=self.c.round,
                state_hash=self.c.hashes[self.c.round],
                shard_index=record.shard_index,
                shard_count=len(self.c.sites),
                num_params=self.c.num_params,
                heartbeat_interval_s=self.c.cfg.heartbeat_interval_s,
                finished=self.c.finished,
                data=ranges_to_proto(self.c.data_for(request.site)),
                key_id=self.security.keyring.site(request.site).key_id if self.security.keyring else 0,
            )

        return await self._unary("Join", request, context, handle)

    async def Heartbeat(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def handle() -> Any:
            self.c.member(request.site, request.run_id)
            return outer_sync_pb2.HeartbeatResponse(
                round=self.c.round, lease_s=self.c.cfg.lease_s, finished=self.c.finished
            )

        return await self._unary("Heartbeat", request, context, handle)

    async def Report(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def handle() -> Any:
            if request.eval_count and not math.isfinite(request.eval_loss_sum):
                raise InvalidArgument("eval_loss_sum must be finite")
            limit = self.c.cfg.limits.max_tokens
            if request.eval_count > limit or request.tokens > limit:
                raise InvalidArgument(f"eval_count or tokens exceeds limits.max_tokens {limit}")
            ok, expected = await self.c.report(
                request.site,
                request.run_id,
                request.round,
                request.state_hash,
                request.eval_loss_sum,
                request.eval_count,
                _finite_or_zero(request.train_loss),
            )
            self.journal.write(
                "report",
                site=request.site,
                round=request.round,
                eval_loss_sum=request.eval_loss_sum,
                eval_count=request.eval_count,
                train_loss=_finite_or_zero(request.train_loss),
                tokens=request.tokens,
                compute_s=_finite_or_zero(request.compute_seconds),
            )
            return outer_sync_pb2.ReportResponse(hash_ok=ok, expected_hash=expected)

        return await self._unary("Report", request, context, handle)

    async def Leave(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def handle() -> Any:
            await self.c.leave(request.site, request.run_id, request.reason)
            return outer_sync_pb2.LeaveResponse()

        return await self._unary("Leave", request, context, handle)

    async def PushDelta(self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        site, round_, fragment, payload_bytes, wire_bytes = "", 0, 0, 0, 0
        timeout_s = self.c.cfg.limits.chunk_timeout_s
        assembly: Assembly | None = None
        first: Any = None
        started = time.time()
        covered = 0
        try:
            duplicate = False
            index = 0
            while (chunk := await _next_chunk(request_iterator, timeout_s)) is not None:
                h = chunk.header
                opened = None
                if first is None:
                    require_site(self.security, context, h.site)
                    first, site, round_, fragment = chunk, h.site, h.round, h.fragment
                    assembly, opened = self._begin_part(chunk)
                    duplicate = assembly is None
                self._count(site, received=chunk)
                wire_bytes += chunk.ByteSize()
                segment = self._check_chunk(first, chunk, index)
                covered += segment.numel
                payload_bytes += len(chunk.payload)
                if assembly is not None:
                    out = assembly.claim(first.part, segment)
                    payload = opened if opened is not None else self._open(chunk)
                    values = await asyncio.to_thread(
                        self.c.uplink.decode, payload, h.numel, Place(h.round, segment)
                    )
                    out.copy_(values.view(out.shape))
                index += 1
            if first is None:
                raise InvalidArgument("empty push: no chunks received")
            if index != first.total_chunks:
                raise InvalidArgument(f"push part ended after {index} of {first.total_chunks} chunks")
            outcome = "duplicate" if assembly is None else await self._finish_part(first, assembly)
            duplicate = outcome == "duplicate"
        except REFUSALS as exc:
            self._abandon(first, assembly)
            self.c.record_rejection(site, exc)
            outcome = "late" if isinstance(exc, LateContribution) else "rejected"
            self._pushed(site, round_, started, wire_bytes, outcome, _status(exc).name)
            await _abort(context, "PushDelta", site, exc)
        except BaseException:  # cancelled (the stream broke): the retry must find the part free
            self._abandon(first, assembly)
            raise
        self._pushed(site, round_, started, wire_bytes, outcome)
        if not duplicate:
            self.metrics.push_compressed(site, covered, payload_bytes)
        ack = outer_sync_pb2.PushAck(
            round=round_, fragment=fragment, duplicate=duplicate, payload_bytes=payload_bytes
        )
        self._count(site, sent=ack)
        return ack

    def _abandon(self, first: Any, assembly: Assembly | None) -> None:
        """Give back what a failed part claimed; an assembly no part completed goes entirely."""
        if assembly is None:
            return
        assembly.abandon(first.part)
        key = (first.header.site, first.header.round)
        if not assembly.received and not assembly.streaming and self.assemblies.get(key) is assembly:
            del self.assemblies[key]

    def _pushed(
        self, site: str, round_: int, started: float, wire_bytes: int, outcome: str, reason: str = ""
    ) -> None:
        """Metrics and journal for one push stream: a whole contribution accepted, one part of
        it received ("part"), a duplicate, or a refusal (late, rejected)."""
        self.metrics.contribution(site, outcome, reason)
        self.journal.write(
            "push", site=site, round=round_, t0=started, t1=time.time(), bytes=wire_bytes, outcome=outcome
        )

    def _begin_part(self, chunk: Any) -> tuple[Assembly | None, bytes | None]:
        """The assembly this part goes into and its first payload, authenticated before anything
        of the chunk is trusted; (None, None) when the push is a duplicate (nothing to do)."""
        h = chunk.header
        if self.c.check_push(h.site, h.run_id, h.round):
            return None, None
        if h.fragment != 0:
            raise InvalidArgument(f"fragment {h.fragment} does not exist; this run has one fragment (0)")
        if h.codec != self.c.uplink.spec:
            raise InvalidArgument(f"codec {h.codec!r} is not this run's uplink codec {self.c.uplink.spec!r}")
        check_declared(self.c.cfg.limits, chunk, self.c.num_params)
        parts = chunk.parts or 1
        opened = self._open(chunk)
        for key in [k for k in self.assemblies if k[1] < self.c.round]:  # rounds that closed
            del self.assemblies[key]
        data = ranges_from_proto(chunk.data)
        assembly = self.assemblies.get((h.site, h.round))
        if assembly is None:
            assembly = Assembly.open(h.round, self.c.num_params, parts, chunk.tokens, data)
            self.assemblies[(h.site, h.round)] = assembly
        if not assembly.begin(chunk.part, parts, chunk.tokens, data):
            return None, None
        return assembly, opened

    async def _finish_part(self, first: Any, assembly: Assembly) -> str:
        """Record a complete part; the last one hands the whole contribution to the controller.
        Returns "part", "accepted" (the contribution is in) or "duplicate"."""
        h = first.header
        assembly.finish(first.part)
        if not assembly.complete:
            return "part"
        del self.assemblies[(h.site, h.round)]
        assembly.check_covered()
        accepted = await self.c.contribute(
            h.site, h.run_id, h.round, assembly.tokens, assembly.values, assembly.data
        )
        return "accepted" if accepted else "duplicate"

    def _open(self, chunk: Any) -> bytes:
        if self.security.keyring is None:
            return bytes(chunk.payload)
        return open_delta(self.security.keyring.site(chunk.header.site).up, chunk)

    def _check_chunk(self, first: Any, chunk: Any, index: int) -> Segment:
        """A chunk consistent with its stream's first one; returns the elements it covers."""
        h, f = chunk.header, first.header
        if h.seq != index:
            raise InvalidArgument(f"chunk {index} carries sequence number {h.seq}")
        if (h.run_id, h.round, h.fragment, h.site, h.codec) != (
            f.run_id,
            f.round,
            f.fragment,
            f.site,
            f.codec,
        ):
            raise InvalidArgument(f"chunk {h.seq} header differs from the stream's first chunk")
        if (chunk.tokens, chunk.total_chunks, chunk.part, chunk.parts) != (
            first.tokens,
            first.total_chunks,
            first.part,
            first.parts,
        ):
            raise InvalidArgument(f"chunk {h.seq}: tokens, total_chunks or part changed mid-stream")
        if h.seq >= first.total_chunks:
            raise InvalidArgument(f"chunk {h.seq} is beyond the declared {first.total_chunks} chunks")
        segment = _segment(chunk, index)
        check_segment(segment, self.c.num_params, self.c.cfg.compression.chunk_elements, h.seq)
        return segment

    async def PullUpdate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        kind = request.kind
        requested = time.time()
        try:
            require_site(self.security, context, request.site)
            self._count(request.site, received=request)
            self.c.member(request.site, request.run_id)
            limit = self.c.cfg.limits.max_parts
            if not 0 <= request.part < max(request.parts, 1) <= limit:
                raise InvalidArgument(
                    f"part {request.part} of {request.parts} is out of range (limits.max_parts {limit})"
                )
            if kind == outer_sync_pb2.PullRequest.UPDATE:
                update = await self._wait_for_update(request.round, request.site)
                if update is not None:
                    chunks, codec, digest = update.chunks, update.codec, update.state_hash
                    next_round, round_ = update.round + 1, update.round
                else:
                    kind = outer_sync_pb2.PullRequest.FULL_STATE
            elif kind != outer_sync_pb2.PullRequest.FULL_STATE:
                raise InvalidArgument("PullRequest.kind must be UPDATE or FULL_STATE")
            if kind == outer_sync_pb2.PullRequest.FULL_STATE:
                await self.c.settle()  # never a state that a commit in progress has not made durable
                state = self.c.full_state()
                chunks, codec, digest = state.chunks, state.codec, state.state_hash
                next_round = round_ = state.round
        except REFUSALS as exc:
            await _abort(context, "PullUpdate", request.site, exc)
        keys = self.security.keyring.site(request.site) if self.security.keyring else None
        ready, sent = time.time(), 0
        parts = request.parts or 1
        mine = [(seq, chunk) for seq, chunk in enumerate(chunks) if seq % parts == request.part]
        if not mine:  # more pullers than chunks: this one gets the stream's facts, no payload
            mine = [(len(chunks), EncodedChunk(0, 0, b""))]
        for i, (seq, chunk) in enumerate(mine):
            message = outer_sync_pb2.UpdateChunk(
                header=outer_sync_pb2.ChunkHeader(
                    run_id=self.c.cfg.run_id,
                    round=round_,
                    fragment=0,
                    site=request.site,
                    codec=codec,
                    seq=seq,
                    start=chunk.start,
                    numel=chunk.numel,
                ),
                payload=chunk.payload,
                next_round=next_round,
                state_hash=digest,
                total_chunks=len(chunks),
                finished=next_round >= self.c.cfg.rounds,
                kind=kind,
                data=ranges_to_proto(self.c.data_for(request.site)) if i == len(mine) - 1 else [],
            )
            if keys is not None:
                seal_update(keys.down, message)
            self._count(request.site, sent=message)
            sent += message.ByteSize()
            yield message
        self.journal.write(
            "pull",
            site=request.site,
            round=round_,
            kind="full_state" if kind == outer_sync_pb2.PullRequest.FULL_STATE else "update",
            t0=requested,
            t_ready=ready,
            t1=time.time(),
            bytes=sent,
        )

    async def _wait_for_update(self, round_: int, site: str) -> Any:
        """The server's own bound on a pull's wait, whatever deadline the client set."""
        limit = self.c.cfg.round_timeout_s + 300
        try:
            return await asyncio.wait_for(self.c.wait_for_update(round_, site), limit)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"round {round_} did not commit within {limit:.0f}s; pull again") from None


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """Status for everyone with a certificate of the run's CA; details and Shutdown for admins."""

    def __init__(
        self, controller: RoundController, on_shutdown: Callable[[float], None], security: ServerSecurity
    ) -> None:
        self.c = controller
        self.on_shutdown = on_shutdown
        self.security = security

    async def GetStatus(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        full = status_message(self.c)
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

    async def Shutdown(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if not is_admin(self.security, context):
            log.warning("[Admin.Shutdown] peer=%s refused (PERMISSION_DENIED): not an admin", context.peer())
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "Shutdown needs an admin certificate")
        if not math.isfinite(request.grace_s) or not 0 <= request.grace_s <= 3600:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "grace_s must be in [0, 3600]")
        log.info("[Admin.Shutdown] requested, grace %.1fs", request.grace_s)
        self.on_shutdown(request.grace_s)
        return admin_pb2.ShutdownResponse()


def status_message(c: RoundController) -> Any:
    now = time.monotonic()
    sites = [
        admin_pb2.SiteStatus(
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
            rejected=s.rejected,
            late=s.late,
            hash_ok=s.hash_ok,
            last_report_round=s.last_report_round,
        )
        for s in c.sites.values()
    ]
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
        num_params=c.num_params,
        data_windows_consumed=c.ledger.progress()[0],
        data_windows_total=c.ledger.progress()[1],
    )
