"""The values a site and the coordinator exchange, free of any transport.

The site's outer loop (:mod:`geodiloco.site.outer_sync`) and its links speak these; the one
module that turns them into protocol messages and back is :mod:`geodiloco.wire`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar, overload

from geodiloco.compression import EncodedChunk
from geodiloco.segment import Segment
from geodiloco.workload.data import DataRange

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class FragmentState:
    """Where one fragment of the global state stands on the coordinator."""

    round: int  # the fragment's open round
    state_hash: str  # of the fragment's global values at that round
    finished: bool


@dataclass(frozen=True, slots=True)
class JoinInfo:
    run_id: str
    run_config_json: str
    round: int
    state_hash: str
    shard_index: int
    shard_count: int
    num_params: int
    heartbeat_interval_s: float
    finished: bool
    data: list[DataRange]  # what to train on in `round`
    key_id: int = 0  # the sealing key id the run expects from this site (0: not sealed)
    # every fragment's state, in order; a coordinator that keeps one fragment may send none
    fragments: tuple[FragmentState, ...] = ()

    @property
    def fragment_states(self) -> tuple[FragmentState, ...]:
        """Every fragment's state (one, from the run's own fields, when the coordinator sent none)."""
        return self.fragments or (FragmentState(self.round, self.state_hash, self.finished),)


@dataclass(frozen=True, slots=True)
class WireChunk:
    """One encoded chunk of a push and the canonical elements it covers."""

    segment: Segment
    payload: bytes


class LazyChunks(Sequence[WireChunk]):
    """A push's chunks, each made by :meth:`chunk` only when the push stream takes it, so that
    chunk i+1 is encoded while chunk i is on the wire."""

    @abstractmethod
    def chunk(self, i: int) -> WireChunk:
        """Chunk ``i`` (0 <= i < len)."""

    @overload
    def __getitem__(self, i: int) -> WireChunk: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[WireChunk]: ...
    def __getitem__(self, i: int | slice) -> WireChunk | Sequence[WireChunk]:
        if isinstance(i, slice):
            return [self.chunk(j) for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.chunk(i)

    def __iter__(self) -> Iterator[WireChunk]:
        return (self.chunk(i) for i in range(len(self)))


class Strided(Sequence[T]):
    """Every ``step``-th item of ``items`` from ``first``, each taken from ``items`` only when
    asked for: a lazily encoded push stays lazy on each of several streams."""

    def __init__(self, items: Sequence[T], first: int, step: int) -> None:
        self._items, self._indices = items, range(first, len(items), step)

    def __len__(self) -> int:
        return len(self._indices)

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[T]: ...
    def __getitem__(self, i: int | slice) -> T | Sequence[T]:
        if isinstance(i, slice):
            return [self._items[j] for j in self._indices[i]]
        return self._items[self._indices[i]]


def strided(items: Sequence[T], first: int, step: int) -> Sequence[T]:
    """:class:`Strided`, or ``items`` itself when that is all of it."""
    return items if (first, step) == (0, 1) else Strided(items, first, step)


@dataclass(frozen=True, slots=True)
class StreamFacts:
    """What every chunk of one pull stream shares; a chunk's bytes mean something only with
    them (an update's chunk is added, a full state's replaces)."""

    is_full_state: bool
    codec: str
    round: int
    state_hash: str


ChunkSink = Callable[[int, EncodedChunk, StreamFacts], None]  # (seq, chunk, its stream's facts)


def without_payload(chunk: EncodedChunk) -> EncodedChunk:
    """``chunk``'s place, its bytes dropped: what a pull keeps of a chunk its sink took."""
    return EncodedChunk(chunk.start, chunk.numel, b"")


@dataclass(frozen=True, slots=True)
class PulledPart:
    """What one puller received of an update or full state: its share of the chunks (opened,
    still encoded) and the stream's facts, which are the same for every puller."""

    is_full_state: bool
    codec: str
    total_chunks: int
    chunks: dict[int, EncodedChunk]  # by sequence number; payloads empty if the sink took them
    round: int  # the round the update closes, or the round of the full state
    next_round: int
    state_hash: str
    finished: bool
    data: list[DataRange]  # what to train on in `next_round`

    @property
    def facts(self) -> tuple[bool, str, int, int, int, str, bool, list[DataRange]]:
        return (
            self.is_full_state,
            self.codec,
            self.total_chunks,
            self.round,
            self.next_round,
            self.state_hash,
            self.finished,
            self.data,
        )

    @property
    def stream(self) -> StreamFacts:
        return StreamFacts(self.is_full_state, self.codec, self.round, self.state_hash)


def wire_chunk(chunk: WireChunk | EncodedChunk) -> WireChunk:
    if isinstance(chunk, WireChunk):
        return chunk
    # bytes(b) of a bytes object is that object: a copy only for a view
    return WireChunk(Segment(chunk.start, 1, chunk.numel, chunk.numel), bytes(chunk.payload))


@dataclass(frozen=True, slots=True)
class PushPart:
    """One part of a site's pseudo-gradient for one fragment round: what a push carries.

    ``data`` is what the site trained on (None: a fragment that does not settle the data ledger,
    or, for the gRPC client, the data the coordinator last assigned); ``part`` of ``parts`` is
    which of the site's streams this is (one per rank and stream)."""

    fragment: int
    round: int
    codec: str
    chunks: Sequence[WireChunk | EncodedChunk]
    tokens: int
    data: list[DataRange] | None = None
    part: int = 0
    parts: int = 1


@dataclass(frozen=True, slots=True)
class Served:
    """What a pull streams: this puller's share of an update's or a state's chunks, by sequence
    number, with the facts every chunk of the stream carries."""

    full_state: bool
    codec: str
    round: int  # the round the update closes, or the round of the full state
    next_round: int
    state_hash: str
    total_chunks: int
    finished: bool
    mine: list[tuple[int, EncodedChunk]]  # (seq, chunk); one empty chunk when none is this puller's
    data: list[DataRange]  # what to train on in ``next_round``; only on a stream that settles data


@dataclass(frozen=True, slots=True)
class PullShare:
    """What a pull asks for: puller ``part`` of ``parts``' share of the update closing a fragment's
    ``round`` (waited for until it commits), or of the fragment's current full state."""

    fragment: int
    round: int
    full_state: bool
    part: int = 0
    parts: int = 1


@dataclass(frozen=True, slots=True)
class RoundReport:
    """A site's word after a fragment round: the hash of its copy of the global values, and the
    metrics of its training (evaluation only on the fragment that settles the data)."""

    fragment: int
    round: int
    state_hash: str
    eval_loss_sum: float
    eval_count: int
    train_loss: float
    tokens: int
    compute_seconds: float
