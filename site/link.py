"""The seam between the site's outer loop and whatever carries it to the coordinator.

:class:`~geodiloco.site.outer_sync.OuterSync` talks only to a :class:`Link`: join, push, pull,
report, leave. The gRPC client is one implementation (:mod:`.edge.grpc_link`); an in-process one
over a round controller (:mod:`geodiloco.testing.local_link`) runs the whole algorithm, both sides, in a unit
test. Refusals arrive as the domain errors below, never as transport errors, so the loop's
recovery (push again, rejoin and catch up) reads the same whatever the transport.

Every call names a fragment: the canonical parameter vector is split into ``outer.fragments``
fragments (:mod:`.fragment_schedule`), each with its own rounds, outer optimizer and hashes on the
coordinator's side. A run of one fragment is the classic DiLoCo of the paper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from geodiloco.exchange import (
    ChunkSink,
    FragmentState,
    JoinInfo,
    PulledPart,
    PullShare,
    PushPart,
    RoundReport,
    WireChunk,
)

__all__ = [
    "ChunkSink",
    "FragmentState",
    "JoinInfo",
    "Joined",
    "Late",
    "Link",
    "LinkError",
    "PullShare",
    "PulledPart",
    "PushAgain",
    "PushPart",
    "Resync",
    "RoundReport",
    "WireChunk",
]


class LinkError(Exception):
    """The coordinator refused a call, or could not be reached after the link's own retries."""


class PushAgain(LinkError):
    """The coordinator lost this site's uncommitted contribution (it restarted): push it again."""


class Resync(LinkError):
    """The round closed without this site, or its membership lapsed: rejoin and catch up."""


class Late(Resync):
    """A push for a fragment round that already closed without it: dropped and counted."""


@dataclass(frozen=True, slots=True)
class Joined:
    """What Join tells a site: the run, and the state of each of its fragments."""

    info: JoinInfo
    fragments: tuple[FragmentState, ...]


def push_streams(streams: int, chunks: int) -> int:
    """How many parts a rank's push of ``chunks`` chunks goes out as on a link of ``streams``
    streams: one per stream, each with at least one chunk."""
    return max(1, min(streams, chunks))


def puller_of(seq: int, pullers: int, streams: int) -> int:
    """Which of ``pullers`` ranks pulls chunk ``seq`` when each pulls on ``streams`` streams:
    stream ``k`` of rank ``r`` asks for the chunks with ``seq % (pullers * streams) == r *
    streams + k``."""
    return seq % (pullers * streams) // streams


class Link(Protocol):
    """One site rank's connection to the run's coordinator, whatever carries it."""

    @property
    def streams(self) -> int:
        """Connections a push or a pull of this rank is spread over (see :func:`push_streams`
        and :func:`puller_of`)."""
        ...

    @property
    def bytes_sent(self) -> int:
        """Bytes this link sent (wire bytes for gRPC)."""
        ...

    @property
    def bytes_received(self) -> int:
        """Bytes this link received."""
        ...

    def join(self, world_size: int) -> Joined:
        """Join (or rejoin) the run with ``world_size`` data-parallel replicas."""
        ...

    def adopt(self, run_id: str, key_id: int) -> None:
        """Act in a run another rank of this site joined."""
        ...

    def keep_alive(self, interval_s: float, world_size: int) -> None:
        """Keep the site's lease alive in the background until :meth:`close` (rank 0)."""
        ...

    def push(self, part: PushPart, *, timeout_s: float) -> None:
        """Send one part of a fragment round's pseudo-gradient (idempotent)."""
        ...

    def pull(
        self,
        share: PullShare,
        *,
        timeout_s: float,
        on_chunk: ChunkSink | None = None,
        keep_payloads: bool = True,
    ) -> PulledPart:
        """This puller's share of an update (waits for its commit) or of the current full state;
        ``on_chunk`` and ``keep_payloads`` as in
        :meth:`geodiloco.site.edge.client.OuterSyncClient.pull`."""
        ...

    def report(self, report: RoundReport) -> bool:
        """The site's hash of a fragment after a round closed, and its metrics; True when the
        coordinator's hash agrees."""
        ...

    def leave(self, reason: str) -> None:
        """Leave the run; its lease ends now."""
        ...

    def close(self) -> None:
        """Stop the heartbeat and release the connection."""
        ...
