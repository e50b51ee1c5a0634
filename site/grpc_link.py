"""The :class:`~geodiloco.site.link.Link` over gRPC: the site's :class:`OuterSyncClient`, with
its status codes translated into the link's domain errors.

Every push, pull and report names its fragment on the wire; Join answers every fragment's round
and hash (a coordinator of one fragment may answer only the run's own fields: one fragment).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc

from geodiloco.compression import EncodedChunk
from geodiloco.security.tls import TlsFiles
from geodiloco.site.client import ChunkSink, Heartbeater, OuterSyncClient, PulledPart, WireChunk
from geodiloco.site.link import Joined, Late, LinkError, PushAgain, Resync
from geodiloco.workload.data import DataRange

T = TypeVar("T")


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
    """One site rank's link to a gRPC coordinator."""

    def __init__(
        self,
        target: str,
        site: str,
        *,
        tls: TlsFiles | None = None,
        site_secret: bytes | None = None,
    ) -> None:
        self.client = OuterSyncClient(target, site, tls=tls, site_secret=site_secret)
        self._heartbeat: Heartbeater | None = None

    @property
    def bytes_sent(self) -> int:
        return self.client.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.client.bytes_received

    def join(self, world_size: int) -> Joined:
        info = _call(lambda: self.client.join(world_size=world_size))
        return Joined(info, info.fragment_states)

    def adopt(self, run_id: str, key_id: int) -> None:
        self.client.adopt(run_id, key_id)

    def keep_alive(self, interval_s: float, world_size: int) -> None:
        self._heartbeat = Heartbeater(self.client, interval_s, world_size)
        self._heartbeat.start()

    def push(
        self,
        fragment: int,
        round_: int,
        codec: str,
        chunks: Sequence[WireChunk | EncodedChunk],
        tokens: int,
        data: list[DataRange] | None,
        *,
        part: int,
        parts: int,
        timeout_s: float,
    ) -> None:
        if self._heartbeat is not None and data is not None:  # the run's round: the primary fragment's
            self._heartbeat.round = round_
        _call(
            lambda: self.client.push(
                round_,
                codec,
                chunks,
                tokens,
                [] if data is None else data,  # a fragment that does not settle the ledger: none
                timeout_s=timeout_s,
                part=part,
                parts=parts,
                fragment=fragment,
            )
        )

    def pull(
        self,
        fragment: int,
        round_: int,
        *,
        full_state: bool,
        part: int,
        parts: int,
        timeout_s: float,
        on_chunk: ChunkSink | None = None,
    ) -> PulledPart:
        return _call(
            lambda: self.client.pull(
                round_,
                full_state=full_state,
                timeout_s=timeout_s,
                part=part,
                parts=parts,
                fragment=fragment,
                on_chunk=on_chunk,
            )
        )

    def report(
        self,
        fragment: int,
        round_: int,
        state_hash: str,
        eval_loss_sum: float,
        eval_count: int,
        train_loss: float,
        tokens: int,
        compute_seconds: float,
    ) -> bool:
        response = _call(
            lambda: self.client.report(
                round_, state_hash, eval_loss_sum, eval_count, train_loss, tokens, compute_seconds, fragment
            )
        )
        return bool(response.hash_ok)

    def leave(self, reason: str) -> None:
        if self._heartbeat is not None:  # first: a beat refused after Leave would rejoin the site
            self._heartbeat.stop()
        _call(lambda: self.client.leave(reason))

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
        self.client.close()
