"""A single-rank site's pull applied to its snapshot chunk by chunk, as the stream brings it, so
that decoding overlaps the chunks still on the wire. (A site of several ranks shares each chunk
with the ranks that hold its elements once the pull is over: collectives cannot run on the
thread that pulls.)

A stream retried after a break brings its chunks again, and an update's chunk is an addition:
adding one twice would corrupt θ. So a chunk is applied once per stream (its facts) and sequence
number, across the retries of one pull and the pulls of one round (a failed exchange pulls the
same committed update again; committed updates are durable, so a restarted coordinator serves
the same bytes). A full state replaces every element, so it may follow a partly applied update;
an update after a partly applied other stream cannot be made right and is refused. A link of
several streams calls the sink from each stream's thread: one chunk is applied at a time.

An update's chunk is hashed as it is added (:meth:`ShardMap.add_encoded_range`), so the state
hash of the new snapshot is the sum of its chunks' checksums (:meth:`ApplyAsPulled.digest`), not
another pass over the model. On a GPU (a resident :class:`~geodiloco.compression.staging.Staging`)
a chunk's raw bytes are copied to the device from a pinned buffer and decoded, added and hashed
there on the staging's side stream; the hash's sums are read once, when the digest is asked for.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from geodiloco.compression import EncodedChunk, Pipeline, Place, parse_pipeline
from geodiloco.compression.staging import Staging
from geodiloco.exchange import PulledPart, StreamFacts
from geodiloco.params import Checksum, DeviceSums
from geodiloco.site.shards import ShardMap


class TornSnapshot(RuntimeError):
    """The snapshot holds part of one stream and cannot take another update on top of it."""


class ApplyAsPulled:
    """An ``on_chunk`` sink that applies each chunk to the snapshot once (see the module)."""

    def __init__(
        self, shards: ShardMap, snapshot: Callable[[], list[torch.Tensor]], staging: Staging | None = None
    ) -> None:
        self._shards = shards
        self._snapshot = snapshot
        self._staging = staging if staging is not None else Staging(shards.device)
        self._facts: StreamFacts | None = None
        self._codec: Pipeline | None = None
        self._done: dict[int, tuple[int, int, int]] = {}  # seq -> start, numel, elements written
        self._hashed: dict[int, Checksum | DeviceSums | None] = {}  # seq -> what it wrote, hashed
        self._lock = threading.Lock()

    @property
    def touched(self) -> bool:
        """Whether some chunk has changed the snapshot."""
        return self.written > 0

    def __call__(self, seq: int, chunk: EncodedChunk, facts: StreamFacts) -> None:
        with self._lock:
            self._apply(seq, chunk, facts)

    @torch.no_grad()
    def _apply(self, seq: int, chunk: EncodedChunk, facts: StreamFacts) -> None:
        if facts != self._facts:
            if self.touched and not facts.is_full_state:
                raise TornSnapshot(
                    f"the snapshot holds part of round {self._facts.round if self._facts else '?'}'s "
                    f"stream; another update (round {facts.round}) cannot be added to it"
                )
            self._facts, self._codec, self._done, self._hashed = facts, parse_pipeline(facts.codec), {}, {}
        done = self._done.get(seq)
        if done is not None:
            if done[:2] != (chunk.start, chunk.numel):
                raise TornSnapshot(f"chunk {seq} of round {facts.round} came again with other elements")
            return
        written = 0
        hashed: Checksum | DeviceSums | None = Checksum()  # none of its elements held here
        if self._shards.holds(chunk.start, chunk.numel):
            assert self._codec is not None
            place = Place.span(facts.round, chunk.start, chunk.numel)
            if facts.is_full_state:
                written = self._shards.scatter_encoded(
                    self._codec, chunk.payload, place, self._snapshot(), self._staging
                )
                hashed = None
            else:
                written, hashed = self._shards.add_encoded_range(
                    self._codec, chunk.payload, place, self._snapshot(), self._staging
                )
        self._done[seq] = (chunk.start, chunk.numel, written)
        self._hashed[seq] = hashed

    def covers(self, pulled: PulledPart) -> bool:
        """Whether ``pulled`` is the stream applied here, every chunk of it."""
        return pulled.stream == self._facts and pulled.chunks.keys() <= self._done.keys()

    def digest(self, pulled: PulledPart) -> str | None:
        """The state hash of the snapshot once ``pulled`` (an update this sink applied whole) is in
        it, from the checksums taken as its chunks were added; None when one was not taken (a
        full state, a chunk in rows of a sharded matrix) or the sink does not hold the model
        alone, which the caller then hashes as before."""
        if not self.covers(pulled) or any(h is None for h in self._hashed.values()):
            return None
        if self._shards.owned_numel != self._shards.local_numel:
            return None  # replicas share the hash: each adds only what it owns
        total = Checksum()
        with self._staging.side():  # sums still on the device are read after the work that made them
            for part in self._hashed.values():
                assert part is not None
                total = total.merge(part.settle() if isinstance(part, DeviceSums) else part)
        return total.hexdigest() if total.count == self._shards.local_numel else None

    @property
    def written(self) -> int:
        """Elements of the snapshot the current stream has written."""
        return sum(written for _, _, written in self._done.values())
