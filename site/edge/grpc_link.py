"""The :class:`~geodiloco.site.link.Link` over gRPC: the site's :class:`OuterSyncClient`, with
its status codes translated into the link's domain errors.

Every push, pull and report names its fragment on the wire; Join answers every fragment's round
and hash (a coordinator of one fragment may answer only the run's own fields: one fragment).

With ``streams`` > 1 a rank moves its push and its pull on that many TCP connections at once,
for paths where one connection cannot fill the link (a long round trip and the kernel's socket
buffers bound what one TCP connection has in flight). Each stream is a part of its own on the
wire: a push of ``n`` chunks goes out as :func:`push_streams` parts, chunk ``i`` on stream
``i % streams``, and a pull asks for the sub-shares of :func:`~geodiloco.site.link.puller_of`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc

from geodiloco.exchange import ChunkSink, PulledPart, PullShare, PushPart, RoundReport, strided
from geodiloco.security.tls import TlsFiles
from geodiloco.site.edge.client import Heartbeater, OuterSyncClient
from geodiloco.site.link import Joined, Late, LinkError, PushAgain, Resync, push_streams
from geodiloco.site.outer_sync import OuterSync

T = TypeVar("T")
AGREED_PULLS = 3  # pulls on several streams repeated when a commit fell between them


def translate(exc: grpc.RpcError) -> LinkError:
    """The domain error a refusal means to the site's loop."""
    code = exc.code()
    detail = f"{code.name} {exc.details()}"
    if code == grpc.StatusCode.ABORTED:
        return PushAgain(detail)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        # the coordinator's words for a push to a round that closed (LateContribution)
        return Late(detail) if " is closed; the current round is " in detail else Resync(detail)
    return LinkError(detail)


def _call(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except grpc.RpcError as exc:
        raise translate(exc) from exc


class GrpcLink:
    """One site rank's link to a gRPC coordinator, on ``streams`` connections (see the module)."""

    def __init__(
        self,
        target: str,
        site: str,
        *,
        tls: TlsFiles | None = None,
        site_secret: bytes | None = None,
        streams: int = 1,
    ) -> None:
        if streams < 1:
            raise ValueError(f"streams must be at least 1, got {streams}")
        self.clients = [
            OuterSyncClient(target, site, tls=tls, site_secret=site_secret, connection=k)
            for k in range(streams)
        ]
        self.client = self.clients[0]  # joins, beats, reports and leaves
        self._streams = ThreadPoolExecutor(streams, "link-stream") if streams > 1 else None
        self._heartbeat: Heartbeater | None = None

    @property
    def streams(self) -> int:
        return len(self.clients)

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self.clients)

    @property
    def bytes_received(self) -> int:
        return sum(c.bytes_received for c in self.clients)

    def join(self, world_size: int) -> Joined:
        info = _call(lambda: self.client.join(world_size=world_size))
        for other in self.clients[1:]:
            other.adopt(info.run_id, info.key_id)
        return Joined(info, info.fragment_states)

    def adopt(self, run_id: str, key_id: int) -> None:
        for client in self.clients:
            client.adopt(run_id, key_id)

    def wait_for_coordinator(self, patience_s: float) -> None:
        """Retry a lost coordinator for ``patience_s`` on every stream (the run's round timeout,
        once known), so that every rank of the site waits alike."""
        for client in self.clients:
            client.patience_s = patience_s

    def keep_alive(self, interval_s: float, world_size: int) -> None:
        self._heartbeat = Heartbeater(self.client, interval_s, world_size)
        self._heartbeat.start()

    def _on_streams(self, calls: list[Callable[[], T]]) -> list[T]:
        """Each call on its own stream at once; the first failure raised once all are over."""
        if self._streams is None or len(calls) == 1:
            return [_call(calls[0])] if len(calls) == 1 else []
        futures = [self._streams.submit(_call, call) for call in calls]
        for future in futures:
            future.exception()  # wait for every stream before raising
        return [future.result() for future in futures]

    def push(self, part: PushPart, *, timeout_s: float) -> None:
        """Parts ``part.part`` .. ``part.part + push_streams(streams, len(chunks)) - 1`` of ``parts``."""
        if self._heartbeat is not None and part.data is not None:  # the run's round: the primary's
            self._heartbeat.round = part.round
        n = push_streams(self.streams, len(part.chunks))
        data = [] if part.data is None else part.data  # a fragment that does not settle the ledger: none

        def one(k: int) -> Callable[[], object]:
            stream = dataclasses.replace(
                part, chunks=strided(part.chunks, k, n), data=data, part=part.part + k
            )
            return lambda: self.clients[k].push_part(stream, timeout_s=timeout_s)

        self._on_streams([one(k) for k in range(n)])

    def pull(
        self,
        share: PullShare,
        *,
        timeout_s: float,
        on_chunk: ChunkSink | None = None,
        keep_payloads: bool = True,
    ) -> PulledPart:
        """Puller ``share.part`` of ``share.parts``: on each of its streams ``k``, sub-share
        ``part * streams + k`` of ``parts * streams``, merged; pulled again where a commit fell
        between the streams (a full state they do not agree on)."""
        n = self.streams

        def one(k: int) -> Callable[[], PulledPart]:
            return lambda: self.clients[k].pull(
                share.round,
                full_state=share.full_state,
                timeout_s=timeout_s,
                part=share.part * n + k,
                parts=share.parts * n,
                fragment=share.fragment,
                on_chunk=on_chunk,
                keep_payloads=keep_payloads,
            )

        for _ in range(AGREED_PULLS):
            pulled = self._on_streams([one(k) for k in range(n)])
            if all(p.facts == pulled[0].facts for p in pulled):
                return merged(pulled)
        raise LinkError(f"the state kept changing while {n} streams pulled it")

    def report(self, report: RoundReport) -> bool:
        return bool(_call(lambda: self.client.send_report(report)).hash_ok)

    def leave(self, reason: str) -> None:
        if self._heartbeat is not None:  # first: a beat refused after Leave would rejoin the site
            self._heartbeat.stop()
        _call(lambda: self.client.leave(reason))

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self._streams is not None:
            self._streams.shutdown()
        for client in self.clients:
            client.close()


def merged(pulled: list[PulledPart]) -> PulledPart:
    """One puller's share from its streams' sub-shares (which agree on the stream's facts)."""
    if len(pulled) == 1:
        return pulled[0]
    chunks = {seq: chunk for part in pulled for seq, chunk in part.chunks.items()}
    return dataclasses.replace(pulled[0], chunks=chunks)


def connect(
    target: str,
    site: str,
    *,
    tls: TlsFiles | None = None,
    site_secret: bytes | None = None,
    data_parallel_size: int | None = None,
    streams: int = 1,
) -> OuterSync:
    """Join the run at ``target`` over gRPC: :meth:`OuterSync.over` a :class:`GrpcLink`.

    Call it on every rank. ``tls`` (mutual TLS) and ``site_secret`` (payload sealing) are what a
    coordinator started without ``--insecure`` requires. ``data_parallel_size`` as in
    :meth:`OuterSync.over`. ``streams``: TCP connections each rank's push and pull are spread
    over, the same on every rank (see the module); more than one where one cannot fill the WAN
    path."""
    link = GrpcLink(target, site, tls=tls, site_secret=site_secret, streams=streams)
    return OuterSync.over(link, data_parallel_size)
