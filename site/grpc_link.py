"""The :class:`~geodiloco.site.link.Link` over gRPC: the site's :class:`OuterSyncClient`, with
its status codes translated into the link's domain errors.

The gRPC coordinator keeps one fragment per run this version (its wire carries a fragment id
that is always 0): a fragmented run needs the in-process controller until the coordinator
keeps per-fragment rounds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc

from geodiloco.compression import EncodedChunk
from geodiloco.security.tls import TlsFiles
from geodiloco.site.client import Heartbeater, OuterSyncClient, PulledPart, WireChunk
from geodiloco.site.link import FragmentState, Joined, LinkError, PushAgain, Resync
from geodiloco.workload.data import DataRange

T = TypeVar("T")


def translate(exc: grpc.RpcError) -> LinkError:
    """The domain error a refusal means to the site's loop."""
    code = exc.code()
    detail = f"{code.name} {exc.details()}"
    if code == grpc.StatusCode.ABORTED:
        return PushAgain(detail)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return Resync(detail)
    return LinkError(detail)


def _call(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except grpc.RpcError as exc:
        raise translate(exc) from exc


def _only_fragment_zero(fragment: int) -> None:
    if fragment != 0:
        raise LinkError(
            f"fragment {fragment}: the gRPC coordinator keeps one fragment per run (outer.fragments 1)"
        )


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
        return Joined(info, (FragmentState(info.round, info.state_hash, info.finished),))

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
        _only_fragment_zero(fragment)
        if self._heartbeat is not None:
            self._heartbeat.round = round_
        _call(
            lambda: self.client.push(
                round_, codec, chunks, tokens, data, timeout_s=timeout_s, part=part, parts=parts
            )
        )

    def pull(
        self, fragment: int, round_: int, *, full_state: bool, part: int, parts: int, timeout_s: float
    ) -> PulledPart:
        _only_fragment_zero(fragment)
        return _call(
            lambda: self.client.pull(
                round_, full_state=full_state, timeout_s=timeout_s, part=part, parts=parts
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
        _only_fragment_zero(fragment)
        response = _call(
            lambda: self.client.report(
                round_, state_hash, eval_loss_sum, eval_count, train_loss, tokens, compute_seconds
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
