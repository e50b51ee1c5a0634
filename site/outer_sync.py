"""The site side of DiLoCo, wrapped around any model, any parallel layout and any inner loop.

Every rank of the site talks to the coordinator for its own part: it computes the pseudo-gradient
of the elements it owns (its local shard; replicated parameters are split among the ranks that
hold them), compresses and streams them, and pulls its share of the update's chunks. Ranks pass
the pulled chunks (still compressed) to each other over the site's own process group and each
decodes only what lands in its shard, so no rank ever holds the whole model::

    sync = connect("coordinator:50051", site="dc-west", tls=files, site_secret=secret)
    model = sync.attach(model)              # any DDP / FSDP2 / TP wrapping already applied
    while not sync.finished:
        ...; inner_optimizer.step()
        if sync.step(tokens=n):             # every H inner steps: a round closed
            ...                             # e.g. evaluate, then sync.report(...)

The loop talks to the coordinator only through a :class:`~geodiloco.site.link.Link` (gRPC, or
in-process for tests). Streaming DiLoCo (``outer.fragments`` P, ``outer.overlap_steps`` τ,
``outer.mix_alpha`` α): the model is synced in P fragments at staggered steps
(:mod:`.fragments`); with τ > 0 a fragment's push and pull run on a background sender while
training goes on, and τ steps later the fragment's global values are mixed into the local ones.
The site's copy of the *global* state (the snapshot) stays bit-identical with the
coordinator's and is hash-checked per fragment and round.

Rank 0 alone joins, heartbeats, reports and leaves; control decisions (push again, resync) are
agreed by every rank, so the ranks of a site never disagree on the state they hold.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import IntEnum
from typing import TypeVar

import torch
from torch import nn

from geodiloco.compression import ErrorFeedback, Pipeline, Place, parse_pipeline
from geodiloco.compression.staging import Staging
from geodiloco.config import RunConfig
from geodiloco.exchange import LazyChunks, PulledPart, PullShare, PushPart, RoundReport, WireChunk
from geodiloco.params import HASH_BLOCK, Checksum, canonical_parameters
from geodiloco.segment import Segment
from geodiloco.site.fragment_schedule import FragmentPlan, ParameterSubset, Schedule
from geodiloco.site.group import SiteGroup
from geodiloco.site.link import (
    FragmentState,
    Joined,
    JoinInfo,
    Link,
    LinkError,
    PushAgain,
    Resync,
    puller_of,
    push_streams,
)
from geodiloco.site.pull_apply import ApplyAsPulled, TornSnapshot
from geodiloco.site.shards import ShardMap, subview
from geodiloco.workload.data import DataRange, split_windows

log = logging.getLogger("geodiloco.site")

MAX_EXCHANGES = 5
CATCH_UP_ROUNDS = 2  # missed rounds caught up through kept updates (q8: ~1 byte/param each, state ~4)
T = TypeVar("T")


class Outcome(IntEnum):
    """What a rank's last call asks the site to do next; the worst of all ranks wins."""

    OK = 0
    PUSH_AGAIN = 1  # the coordinator lost the uncommitted contribution (restart)
    RESYNC = 2  # the round closed without this site, or its lease lapsed: rejoin, full state
    FAILED = 3


def _outcome(exc: Exception) -> Outcome:
    if isinstance(exc, PushAgain):
        return Outcome.PUSH_AGAIN
    if isinstance(exc, Resync):
        return Outcome.RESYNC
    return Outcome.FAILED


class DeltaEncoding(LazyChunks):
    """A rank's pseudo-gradient, compressed chunk by chunk when the push stream takes it: chunk
    i+1 is encoded while chunk i is on the wire, and each chunk's error-feedback residual is kept
    as it is encoded (no model-sized decoded copy). Encoded chunks are kept for a retried push."""

    def __init__(
        self,
        codec: Pipeline,
        round_: int,
        to_send: torch.Tensor,
        segments: list[tuple[int, Segment]],
        residual: torch.Tensor,
    ) -> None:
        self.codec, self.round, self.to_send, self.segments = codec, round_, to_send, segments
        self.residual = residual
        self._done: dict[int, WireChunk] = {}

    def __len__(self) -> int:
        return len(self.segments)

    def chunk(self, i: int) -> WireChunk:
        chunk = self._done.get(i)
        if chunk is None:
            offset, segment = self.segments[i]
            values = self.to_send[offset : offset + segment.numel]
            with torch.no_grad():
                # on Δ's device: a GPU site quantises there and decodes there for the residual
                residual = self.residual[offset : offset + segment.numel]
                payload = self.codec.encode_with_residual(values, residual, Place(self.round, segment))
            chunk = self._done[i] = WireChunk(segment, payload)
        return chunk

    def finish(self) -> None:
        """Encode what no push took, so the residual covers the whole Δ."""
        for i in range(len(self)):
            self[i]


@dataclass(slots=True)
class RoundResult:
    round: int  # the round just closed
    state_hash: str
    tokens: int
    finished: bool


@dataclass(frozen=True, slots=True)
class Merged:
    """A fragment round this site merged, to be reported with the round's metrics."""

    fragment: int
    round: int
    state_hash: str
    tokens: int


@dataclass(slots=True)
class InFlight:
    """A fragment's push on the background sender, and what to push again if it must."""

    round: int
    chunks: DeltaEncoding
    tokens: int
    data: list[DataRange] | None
    result: Future[tuple[PulledPart | None, Outcome, str | None, float]]  # ..., when it came in


class FragmentSync:
    """One fragment's outer loop on this rank: its global values θ_r (its slice of the owner's
    snapshot), error feedback and rounds; push, pull, recovery and merge."""

    def __init__(
        self, owner: OuterSync, index: int, members: Sequence[int], shards: ShardMap, state: FragmentState
    ) -> None:
        self.owner = owner
        self.index = index
        self.members = list(members)  # canonical parameter indices = the owner's piece indices
        self.shards = shards
        self.round, self.finished = state.round, state.finished
        self.state_hash = state.state_hash  # as joined; checked in attach
        self.settles_data = index == owner.config.outer.fragments - 1  # merged at the round's end
        self.feedback = ErrorFeedback(shards.owned_numel, owner.config.compression.feedback_decay)
        # a rank's push goes out as one part per stream of its link (none where it owns nothing)
        chunks = len(list(shards.wire_segments(owner.config.compression.chunk_elements)))
        mine = push_streams(owner.link.streams, chunks) if shards.owned_numel > 0 else 0
        owners = owner.group.gather(mine)
        self.part, self.parts = sum(owners[: owner.group.rank]), sum(owners)
        self.tokens = 0  # trained since this fragment's last push
        self.numel = 0  # the fragment's parameters, over every rank (set by attach)
        self.in_flight: InFlight | None = None
        self.digest_after = ""  # the snapshot's hash after the last merge
        self.as_pulled: ApplyAsPulled | None = None  # a single rank's pull, applied as it arrives

    @property
    def link(self) -> Link:
        return self.owner.link

    @property
    def group(self) -> SiteGroup:
        return self.owner.group

    @property
    def snapshot(self) -> list[torch.Tensor]:
        """The fragment's global values, laid out like its pieces (views of the owner's snapshot)."""
        return [self.owner.snapshot[i] for i in self.members]

    def digest(self, tensors: list[torch.Tensor] | None = None) -> str:
        self.owner.staging.fence()  # the snapshot as the pulls' work on the side stream left it
        return _digest(self.shards, self.group, tensors)

    def name(self, round_: int) -> str:
        """How logs name one of this fragment's rounds."""
        return (
            f"round {round_}"
            if self.owner.schedule.fragments == 1
            else f"fragment {self.index} round {round_}"
        )

    # -- one fragment round -----------------------------------------------------------------

    def take_tokens(self) -> int:
        """The tokens this fragment's push weighs, summed over the site's ranks."""
        owner = self.owner
        # one fragment synced blocking: the round's count, which a resumed checkpoint restores
        blocking_whole = owner.schedule.fragments == 1 and not owner.schedule.overlap
        local = owner.tokens_in_round if blocking_whole else self.tokens
        self.tokens = 0
        replication = self.group.world // owner.data_parallel_size
        tokens = self.group.sum(local) // max(replication, 1)
        if self.group.rank == 0:  # what the site computed, pushed or not (benchmarks/hetero.py: goodput)
            log.info("%s: pushing %d tokens", self.name(self.round), tokens)
        return tokens

    def sync_now(self) -> None:
        """Push this fragment's pseudo-gradient and merge its committed update (blocking)."""
        round_, data = self.round, self.owner.trained_data() if self.settles_data else None
        tokens = self.take_tokens()
        chunks = self.encode_delta()
        pulled, caught_up = self.exchange(round_, chunks, tokens, data)
        chunks.finish()  # a push cut short (a resync) still leaves the residual of the whole Δ
        self.merge(round_, pulled, tokens, caught_up=caught_up)

    def send(self) -> None:
        """Hand this fragment's pseudo-gradient to the background sender; training goes on."""
        round_, data = self.round, self.owner.trained_data() if self.settles_data else None
        tokens = self.take_tokens()
        chunks = self.encode_delta()  # Δ is taken now; encoding and sending run in the background
        assert self.owner.sender is not None
        result = self.owner.sender.submit(self._push_and_pull, round_, chunks, tokens, data)
        self.in_flight = InFlight(round_, chunks, tokens, data, result)

    def _push_and_pull(
        self, round_: int, chunks: DeltaEncoding, tokens: int, data: list[DataRange] | None
    ) -> tuple[PulledPart | None, Outcome, str | None, float]:
        """The optimistic exchange, on the sender thread: push, pull and, on a site of one rank
        (no collectives needed), decode into the snapshot and hash it; the training thread only
        touches this fragment's snapshot again when it lands. Ranks agree on the outcome then.
        Also returns when the update came in."""
        outcome = Outcome.OK
        if chunks:
            _, outcome = self.owner.call(lambda: self._push(round_, chunks, tokens, data))
        pulled, digest = None, None
        if outcome is Outcome.OK:
            pulled, outcome = self.owner.call(functools.partial(self.pull, round_, False))
        arrived = time.monotonic()
        chunks.finish()
        if pulled is not None and self.group.world == 1:
            digest, outcome = self.owner.call(lambda: self.apply(pulled))
            if outcome is not Outcome.OK:  # the snapshot may be half updated: take the full state
                return None, Outcome.RESYNC, None, arrived
            digest = digest or self.digest(self.snapshot)
        return pulled, outcome, digest, arrived

    def land(self) -> None:
        """Merge the fragment sent τ steps ago: its pull if it went well on every rank, else the
        blocking recovery (push again, or rejoin and catch up) on the training thread."""
        flight, self.in_flight = self.in_flight, None
        assert flight is not None
        round_, tokens = flight.round, flight.tokens
        pulled, outcome, decoded, arrived = flight.result.result()
        outcome = self.group.agree(outcome)
        if outcome is Outcome.OK and self._agreed(pulled):
            assert pulled is not None
            self.owner.clock.arrived = arrived  # the next window starts there (rounds by time)
            if not self._has_data(pulled):
                log.warning("%s: no data assigned (lease lapsed); rejoining", self.name(round_))
                pulled = dataclasses.replace(pulled, data=self.rejoin()[1])
            self.merge(round_, pulled, tokens, decoded=decoded)
            return
        # refused, or ranks pulled different states: rejoin; lost or failed: push again
        resync = outcome in (Outcome.OK, Outcome.RESYNC)
        if outcome is Outcome.PUSH_AGAIN:
            log.warning("%s: the coordinator lost this contribution; pushing again", self.name(round_))
        pulled, caught_up = self.exchange(round_, flight.chunks, tokens, flight.data, resync=resync)
        self.merge(round_, pulled, tokens, caught_up=caught_up)

    def merge(
        self,
        round_: int,
        pulled: PulledPart,
        tokens: int,
        caught_up: bool = False,
        decoded: str | None = None,
    ) -> None:
        """θ_r + update → the snapshot (hash-checked); the parameters take it, or mix it in.
        ``caught_up``: the exchange already brought the snapshot to a later round; ``decoded``:
        the sender already applied the update, and this is the snapshot's hash."""
        if not caught_up and decoded is None:
            decoded = self.apply(pulled)
        digest = decoded if decoded is not None else self.digest(self.snapshot)
        if self.group.rank == 0 and digest != pulled.state_hash:
            log.error(
                "%s: parameters diverged: %s != %s", self.name(round_), digest[:12], pulled.state_hash[:12]
            )
        behind = caught_up or pulled.is_full_state  # a resync: the local progress was on a stale base
        self.adopt(mix=self.owner.schedule.overlap > 0 and not behind)
        self.round, self.finished = pulled.next_round, pulled.finished
        if self.settles_data:
            self.owner.data = pulled.data
        self.digest_after = digest
        if self.group.rank == 0:
            self.owner.merged.append(Merged(self.index, pulled.next_round - 1, digest, tokens))

    @torch.no_grad()
    def adopt(self, mix: bool) -> None:
        """The parameters take the global values (local ← global), or with ``mix``
        local ← α·local + (1−α)·global."""
        alpha = self.owner.config.outer.mix_alpha
        self.owner.staging.fence()  # the training stream reads the snapshot the pull wrote
        for piece, values in zip(self.shards.pieces, self.snapshot, strict=True):
            if mix and alpha:
                piece.local.lerp_(values.to(piece.local.dtype), 1.0 - alpha)
            else:
                piece.local.copy_(values)

    def reload(self) -> PulledPart:
        """The fragment's current global state, lossless; the parameters take it."""
        pulled = self.agreed_pull(full_state=True)
        self.apply(pulled)
        self.adopt(mix=False)
        self.round, self.finished = pulled.next_round, pulled.finished
        self.tokens = 0
        return pulled

    @torch.no_grad()
    def encode_delta(self) -> DeltaEncoding:
        """Δ = θ_r − θ on the owned elements, plus the error-feedback residual, to be compressed
        chunk by chunk as the push stream takes it (see :class:`DeltaEncoding`). Two passes over
        one new buffer: the difference written straight into it, then the residual added in
        place (not a gathered copy of θ_r, and a second buffer for the sum)."""
        to_send = torch.empty(self.shards.owned_numel, dtype=torch.float32, device=self.shards.device)
        self.owner.staging.fence()  # θ_r as the last pull left it
        at = 0
        for (owned, live), (_, base) in zip(
            self.shards.owned_views(), self.shards.owned_views(self.snapshot), strict=True
        ):
            n = owned.segment.numel
            torch.sub(base, live, out=to_send[at : at + n].view(live.shape))
            at += n
        self.feedback.compensate(to_send, out=to_send)
        if self.owner.tamper is not None:  # tests: a fault plan's poison replaces what is sent
            self.owner.tamper(self.round, self.index, to_send, self.numel)
        segments = list(self.shards.wire_segments(self.owner.config.compression.chunk_elements))
        return DeltaEncoding(self.owner.uplink, self.round, to_send, segments, self.feedback.residual)

    def _push(
        self, round_: int, chunks: Sequence[WireChunk], tokens: int, data: list[DataRange] | None
    ) -> None:
        part = PushPart(
            self.index, round_, self.owner.uplink.spec, chunks, tokens, data, self.part, self.parts
        )
        self.link.push(part, timeout_s=self.owner.pull_timeout_s)

    def _agreed(self, pulled: PulledPart | None) -> bool:
        """Every rank pulled the same stream facts (no commit in between)."""
        facts = pulled.facts if pulled is not None else None
        return len({repr(f) for f in self.group.gather(facts)}) == 1

    def _has_data(self, pulled: PulledPart | None) -> bool:
        """False when the fragment settling the data committed while this site was counted lost
        (no data is reserved for it)."""
        return pulled is not None and (not self.settles_data or pulled.finished or bool(pulled.data))

    def exchange(
        self,
        round_: int,
        chunks: Sequence[WireChunk],
        tokens: int,
        data: list[DataRange] | None,
        resync: bool = False,
    ) -> tuple[PulledPart, bool]:
        """Push (idempotent) and pull the round's update, all ranks together.

        Recovers from a restarted coordinator that lost the uncommitted contribution (push
        again) and from a lapsed membership or a round that closed without this site (rejoin
        and continue from the coordinator's current state). True when the update was applied.
        """
        for _ in range(MAX_EXCHANGES):
            if not resync and chunks:
                _, outcome = self.owner.call(lambda: self._push(round_, chunks, tokens, data))
                outcome = self.group.agree(outcome)
                if outcome is Outcome.FAILED:
                    raise RuntimeError(f"round {round_}: a rank of this site could not push its part")
                resync = outcome is Outcome.RESYNC
            elif not resync:
                self.group.agree(Outcome.OK)  # a rank that owns nothing still takes part
            if resync:
                current, assigned = self.rejoin()
                if self._push_again(round_, current, data, assigned):  # the same on every rank
                    resync = False
                    continue
                caught = self.catch_up(round_, current)
                if caught is not None:
                    return caught, True
            pulled, outcome = self.owner.call(functools.partial(self.pull, round_, resync))
            outcome = self.group.agree(outcome)
            if outcome is Outcome.FAILED:
                raise RuntimeError(f"round {round_}: a rank of this site could not pull its share")
            if outcome is Outcome.PUSH_AGAIN:
                log.warning("%s: the coordinator lost this contribution; pushing again", self.name(round_))
                continue
            if outcome is Outcome.RESYNC:
                log.warning("%s refused; rejoining and resyncing", self.name(round_))
                resync = True
                continue
            assert pulled is not None
            if not self._agreed(pulled):
                log.warning(
                    "%s: ranks pulled different states (a commit in between); again", self.name(round_)
                )
                resync = True
                continue
            if not self._has_data(pulled):
                log.warning("%s: no data assigned (lease lapsed); rejoining", self.name(round_))
                return dataclasses.replace(pulled, data=self.rejoin()[1]), False
            return pulled, False
        raise RuntimeError(f"round {round_}: no update after {MAX_EXCHANGES} attempts")

    def _push_again(
        self, round_: int, current: int, data: list[DataRange] | None, assigned: list[DataRange]
    ) -> bool:
        """After a rejoin, whether to push this fragment's round again rather than take its state.

        With P > 1 fragments: a round still open (the membership had lapsed, e.g. a restarted
        coordinator) must get this site's contribution now. Taking the state instead would leave
        the fragment without it until the site's next round, while the site waits on its other
        fragments, whose rounds the other sites cannot finish without it: a wait cycle. (One
        fragment resyncs to the start of the round, which has no such cycle.)"""
        return (
            self.owner.schedule.fragments > 1
            and current == round_
            and (not self.settles_data or data == assigned)
        )

    def rejoin(self) -> tuple[int, list[DataRange]]:
        """Rank 0 joins again; every rank learns the fragment's current round and the site's data."""
        joined: Joined | None = None
        outcome = Outcome.OK
        if self.group.rank == 0:
            joined, outcome = self.owner.call(lambda: self.link.join(self.owner.data_parallel_size))
        if self.group.agree(outcome) is not Outcome.OK:
            raise RuntimeError("rejoining the run failed")
        answer = (joined.fragments[self.index].round, joined.info.data) if joined is not None else (0, [])
        return self.group.broadcast(answer)

    def catch_up(self, round_: int, current: int) -> PulledPart | None:
        """From θ_round_ (the snapshot) to the current round through the coordinator's kept
        compressed updates, when only a round or two were missed: the same additions the
        coordinator made, so the result is bit-identical, for a fraction of the state's bytes.
        None when that is not possible (too far behind, updates no longer kept, hash differs):
        the caller pulls the full state."""
        if not 0 < current - round_ <= CATCH_UP_ROUNDS:
            return None
        pulled = None
        for r in range(round_, current):
            pulled = self.agreed_pull(full_state=False, round_=r)
            self.apply(pulled)
            if pulled.is_full_state:  # no longer kept: the coordinator sent its state instead
                return pulled
        assert pulled is not None
        if self.digest(self.snapshot) != pulled.state_hash:
            log.warning("%s: catching up through kept updates missed the hash", self.name(round_))
            return None
        log.info(
            "%s: caught up to round %d with %d kept updates", self.name(round_), current, current - round_
        )
        return pulled

    def pull(self, round_: int, full_state: bool) -> PulledPart:
        """This rank's share of the stream; on a site of one rank, already applied to the
        snapshot (:mod:`.pull_apply`) when it returns, and :meth:`apply` only checks it: the
        payloads are not kept past their chunk's application."""
        if self.group.world == 1 and self.as_pulled is None:
            self.as_pulled = ApplyAsPulled(self.shards, lambda: self.snapshot, self.owner.staging)
        return self.link.pull(
            PullShare(self.index, round_, full_state, self.group.rank, self.group.world),
            timeout_s=self.owner.pull_timeout_s,
            on_chunk=self.as_pulled,
            keep_payloads=self.as_pulled is None,
        )

    def agreed_pull(self, full_state: bool, round_: int | None = None) -> PulledPart:
        """Every rank pulls its share of the same state or update (retried if a commit came in
        between two ranks' full-state pulls)."""
        at = self.round if round_ is None else round_
        for _ in range(MAX_EXCHANGES):
            pulled, outcome = self.owner.call(functools.partial(self.pull, at, full_state))
            if self.group.agree(outcome) is not Outcome.OK:
                raise RuntimeError("pulling the run's state failed")
            assert pulled is not None
            if self._agreed(pulled):
                return pulled
        raise RuntimeError("the run's state kept changing while the site pulled it")

    @torch.no_grad()
    def apply(self, pulled: PulledPart) -> str | None:
        """Decode every chunk on the ranks that hold its elements: snapshot += update (or = state).
        A single rank's pull was applied as it arrived: only its coverage is checked, and the new
        snapshot's state hash, taken as the update's chunks were added, is returned (else None)."""
        as_pulled, self.as_pulled = self.as_pulled, None
        digest = None
        if as_pulled is not None and as_pulled.covers(pulled):
            written, digest = as_pulled.written, as_pulled.digest(pulled)
        elif as_pulled is not None and as_pulled.touched:
            raise TornSnapshot(f"the snapshot holds part of another stream than round {pulled.round}'s")
        else:
            written = self._decode_shared(pulled)
        if written != self.shards.local_numel:
            raise RuntimeError(
                f"the pulled chunks covered {written} of this rank's {self.shards.local_numel} elements"
            )
        return digest

    def _decode_shared(self, pulled: PulledPart) -> int:
        """Each chunk shared by the rank that pulled it and applied where its elements are;
        returns the elements this rank wrote."""
        codec = parse_pipeline(pulled.codec)
        snapshot = self.snapshot
        written = 0
        for seq in range(pulled.total_chunks):
            src = puller_of(seq, self.group.world, self.link.streams)
            chunk = self.group.share_chunk(pulled.chunks.get(seq) if self.group.rank == src else None, src)
            if not self.shards.holds(chunk.start, chunk.numel):
                continue
            place = Place.span(pulled.round, chunk.start, chunk.numel)
            written += self.shards.scatter_encoded(
                codec, chunk.payload, place, snapshot, self.owner.staging, add=not pulled.is_full_state
            )
        return written


def _digest(shards: ShardMap, group: SiteGroup, tensors: list[torch.Tensor] | None) -> str:
    """The canonical state hash of ``shards``' parameters (or of ``tensors`` laid out like them),
    each rank adding the elements it owns."""
    checksum = Checksum()
    for owned, view in shards.owned_views(tensors):
        for offset, segment in owned.segment.split_rows(HASH_BLOCK):
            values = subview(view, owned.segment, offset, segment)
            if segment.contiguous:  # one run of the canonical vector
                checksum.add_range(segment.start, values)
            else:  # rows a stride apart
                checksum.add_rows(segment.start, segment.stride, values)
    total = Checksum()
    for low, high, count in group.gather((checksum.low, checksum.high, checksum.count)):
        total = total.merge(Checksum(low, high, count))
    return total.hexdigest()


@dataclass(slots=True)
class RoundClock:
    """Rounds by time (``inner.round_seconds`` t): where this rank's window of the round ends.

    Blocking, a window counts training only: from the start of the round's first step (what the
    loop does between rounds, e.g. evaluating, is not in it), and the round ends at the first
    step past t. Step times leave out the time the outer sync held the training (``waited``: a
    fast site that waited for a slow one must not take the slow one's step time for its own).

    With τ = ``outer.overlap_steps`` of H = ``inner.steps_per_round``, the exchange overlaps
    τ/H of each site's window, in time, whatever its speed. In one fragment the push is decided
    step by step, at the first step past (1 − τ/H)·t, and the steps left to the window's end at
    the round's step time (one at least) are trained while the push, the commit and the pull
    run. A window then starts when the last round's update came in (a site still training the
    steps its last push named counts them in the new window): every site sees a commit at about
    the same time, so every site pushes at about the same time, and a site that fell behind
    catches up in one round instead of keeping the others waiting at every round.

    Streaming fragments need their push and merge steps fixed when the round starts, so there
    the round's step count is the window over the last round's step time (a site's first round:
    its first step's, at its second step), which scales every fragment's offsets and its overlap
    with it (at least P × (τ' + 1) steps)."""

    seconds: float
    cap: Schedule  # steps_per_round: the most steps a round trains (the windows reserved)
    started: float | None = None  # the end of the round's first step (step times count from it)
    waited: float = 0.0  # seconds of this round the outer sync held the training
    step_s: float | None = None  # the last measured step time
    anchor: float | None = None  # where the window starts, when not at the round's first step
    arrived: float | None = None  # when the update of the round in flight came in: the next anchor

    @property
    def by_time(self) -> bool:
        return self.seconds > 0

    @property
    def on_the_clock(self) -> bool:
        """One fragment: its push is decided step by step (else H is fixed at the round's start)."""
        return self.cap.fragments == 1

    @property
    def overlap_share(self) -> float:
        return self.cap.overlap / self.cap.steps

    def restart(self) -> None:
        """A round starts: its window from the update's arrival, or else its first step."""
        self.started, self.waited = None, 0.0
        self.anchor, self.arrived = self.arrived, None

    def tick(self) -> None:
        """A step ended (call it before the step's outer sync)."""
        if self.started is None:
            self.started = time.monotonic()

    def step_time(self, steps_done: int) -> float | None:
        """This round's step time after ``steps_done`` steps (the last round's after one)."""
        if self.started is not None and steps_done >= 2:
            training = time.monotonic() - self.started - self.waited
            self.step_s = max(training, 1e-9) / (steps_done - 1)
        return self.step_s

    def elapsed(self, steps_done: int) -> float | None:
        """The seconds of the window gone after ``steps_done`` steps (None: no step time yet)."""
        step = self.step_time(steps_done)
        if step is None or self.started is None:
            return None
        if self.anchor is not None:
            return time.monotonic() - self.anchor
        return step * steps_done

    def push_due(self, steps_done: int) -> bool:
        """Whether the window's overlapped part (blocking: its end) has come."""
        elapsed = self.elapsed(steps_done)
        return elapsed is not None and elapsed >= self.seconds * (1 - self.overlap_share)

    def steps_left(self, steps_done: int) -> int:
        """The steps to train after the push, to the window's end at the step time (one at least;
        none blocking). Rank 0's is broadcast."""
        elapsed = self.elapsed(steps_done)
        if not self.cap.overlap or elapsed is None or self.step_s is None:
            return 0
        return max(1, round((self.seconds - elapsed) / self.step_s))

    def scaled(self, steps_done: int, later: int = 0) -> Schedule:
        """The cap with H = the window over the step time after ``steps_done`` steps and τ scaled
        with it, every fragment's push at least ``later`` steps after the round's start."""
        step = self.step_time(steps_done)
        if self.on_the_clock or step is None:
            return self.cap
        steps = round(self.seconds / step)
        overlap = max(1, round(self.cap.overlap * steps / self.cap.steps)) if self.cap.overlap else 0
        overlap = min(overlap, self.cap.overlap)
        low = self.cap.fragments * (overlap + 1 + later)
        steps = max(low, min(self.cap.steps, steps))
        return Schedule(steps, self.cap.fragments, overlap)

    def next_schedule(self, steps_done: int) -> Schedule:
        """The schedule of the round starting now (rank 0's is broadcast); restarts the clock."""
        schedule = self.scaled(steps_done)
        self.restart()
        return schedule


class OuterSync:
    """Snapshots θ_r, computes Δ every H steps (per fragment, at its step), pushes it, and merges
    the outer update."""

    def __init__(self, link: Link, joined: Joined, group: SiteGroup, data_parallel_size: int) -> None:
        self.link = link
        self.info: JoinInfo = joined.info
        self.group = group
        self.data_parallel_size = data_parallel_size
        self.config = RunConfig.from_json(self.info.run_config_json)
        outer = self.config.outer
        if len(joined.fragments) != outer.fragments:
            raise RuntimeError(
                f"the run's outer.fragments is {outer.fragments}, but its coordinator keeps "
                f"{len(joined.fragments)} fragment(s): an older coordinator that cannot stream fragments"
            )
        self.schedule = Schedule(self.config.inner.steps_per_round, outer.fragments, outer.overlap_steps)
        self.clock = RoundClock(self.config.inner.round_seconds, self.schedule)
        self.states = joined.fragments
        self.round = self.info.round
        self.data = self.info.data  # the ledger's windows for the current round
        self.finished = self.info.finished
        self.steps_in_round = 0
        self.tokens_in_round = 0
        # the inner steps this site trained (lr_step in rounds by time): a site that joins a
        # running run without a checkpoint counts the rounds before it at steps_per_round each
        self.steps_trained = self.round * self.config.inner.steps_per_round
        self.uplink = self.config.compression.uplink_pipeline
        self.model: nn.Module | None = None
        self.shards: ShardMap | None = None
        self.snapshot: list[torch.Tensor] = []  # θ_r, laid out like the rank's local pieces
        self.staging = Staging(torch.device("cpu"))  # the model's device's, from attach
        self.fragments: list[FragmentSync] = []
        self.merged: deque[Merged] = deque(maxlen=2 * outer.fragments)  # to report (rank 0)
        self.last_result: RoundResult | None = None
        self.sender = ThreadPoolExecutor(1, "outer-sync") if outer.overlap_steps else None
        # tests: (round, fragment, values, fragment numel) -> None, may replace a push's values in
        # place before encoding (the daemon sets a fault plan's poison here: faults.poison)
        self.tamper: Callable[[int, int, torch.Tensor, int], None] | None = None

    @classmethod
    def over(cls, link: Link, data_parallel_size: int | None = None) -> OuterSync:
        """Join the run over ``link`` (rank 0) and share what the coordinator said with the site's
        ranks; call it on every rank. Over gRPC: :func:`geodiloco.site.connect`.

        ``data_parallel_size`` is how many different batches the site trains on per step (ranks /
        tensor-parallel degree; default: every rank), which sizes its share of the data ledger."""
        group = SiteGroup()
        data_parallel = data_parallel_size or group.world
        joined = link.join(data_parallel) if group.rank == 0 else None
        if joined is not None:
            log.info(
                "joined run %s at round %d (shard %d of %d)",
                joined.info.run_id,
                joined.info.round,
                joined.info.shard_index,
                joined.info.shard_count,
            )
        shared = group.broadcast(joined)
        assert isinstance(shared, Joined)
        if group.rank != 0:
            link.adopt(shared.info.run_id, shared.info.key_id)
        try:
            sync = cls(link, shared, group, data_parallel)
        except RuntimeError:  # a run this coordinator cannot serve: nothing to keep open
            link.close()
            raise
        if group.rank == 0:
            link.keep_alive(shared.info.heartbeat_interval_s, data_parallel)
        return sync

    @property
    def shard_index(self) -> int:
        return self.info.shard_index

    @property
    def shard_count(self) -> int:
        return self.info.shard_count

    def attach(self, model: nn.Module, staging: Staging | None = None) -> nn.Module:
        """Bring ``model`` (already wrapped for its layout) to the run's current global parameters,
        pulling the full state of a fragment only if it differs. ``staging``: how the outer
        sync's bytes cross between the host and the model's device (default: a side stream and
        pinned buffers on a GPU, where updates are decoded; plain copies on the CPU)."""
        self.model = model
        self.shards = ShardMap(model, self.group.rank, self.group.world)
        self.staging = staging if staging is not None else Staging(self.shards.device)
        if self.shards.num_params != self.info.num_params:
            raise ValueError(
                f"model has {self.shards.num_params} parameters, the run has {self.info.num_params}"
            )
        named = canonical_parameters(model)
        plan = FragmentPlan.strided([(n, p.numel()) for n, p in named], self.schedule.fragments)
        self.snapshot = self.shards.clone_locals()
        self.fragments = []
        for index, members in enumerate(plan.members):
            shards = self.shards
            if plan.count > 1:
                shards = ShardMap(
                    ParameterSubset([named[i] for i in members]), self.group.rank, self.group.world
                )
            self.fragments.append(FragmentSync(self, index, members, shards, self.states[index]))
            self.fragments[-1].numel = plan.numel(index)
        for f in self.fragments:
            if f.digest() != f.state_hash:
                f.reload()
                log.info("loaded fragment %d's global state of round %d", f.index, f.round)
        return model

    def reload_global_state(self) -> None:
        """Replace the parameters and snapshot with the run's current global state."""
        for f in self.fragments:
            pulled = f.reload()
            if f.settles_data:
                self.data = pulled.data
        self.round, self.finished = self.fragments[-1].round, all(f.finished for f in self.fragments)
        self.steps_in_round = self.tokens_in_round = 0
        self.clock.restart()

    def digest(self, tensors: list[torch.Tensor] | None = None) -> str:
        """The canonical state hash of the site's parameters (or of ``tensors`` laid out like them),
        each rank adding the elements it owns."""
        assert self.shards is not None
        self.staging.fence()
        return _digest(self.shards, self.group, tensors)

    def step(self, tokens: int) -> bool:
        """Count one inner step of ``tokens`` on this rank, push and merge the fragments due at
        this step; True when it closed a round (every H steps)."""
        if not self.fragments:
            raise RuntimeError("call attach(model) before training")
        self.clock.tick()  # not at the join: building the model, the data and a dry step take seconds
        self.steps_in_round += 1
        self.steps_trained += 1
        self.tokens_in_round += tokens
        at = self.steps_in_round
        # a round by time in one fragment pushes at the first step past its window's overlapped
        # part on any rank's clock (an all-reduce of one flag per step), so every rank agrees,
        # and ends rank 0's count of steps later (blocking: at once)
        due = self.clock.by_time and self.clock.on_the_clock and at < self.schedule.push_step(0)
        if due and self.group.sum(int(self.clock.push_due(at))):
            left = self.group.broadcast(self.clock.steps_left(at)) if self.schedule.overlap else 0
            left = min(left, self.clock.cap.steps - at)  # within the windows reserved
            self.schedule = Schedule(at + left, 1, left)
        if at == 2 and self.clock.by_time and not self.clock.on_the_clock and self.clock.step_s is None:
            # a first round's H, from its first step: no fragment's push before it
            self.schedule = self.group.broadcast(self.clock.scaled(2, later=1))
        held = time.monotonic()
        for f in self.fragments:
            f.tokens += tokens
            if f.in_flight is not None and at == self.schedule.merge_step(f.index):
                f.land()
            elif not f.finished and at == self.schedule.push_step(f.index):
                f.sync_now() if self.sender is None else f.send()
        self.clock.waited += time.monotonic() - held
        if at < self.schedule.steps:
            return False
        self._close_round()
        return True

    def sync(self) -> RoundResult:
        """Sync every fragment now, blocking (a fragment in flight lands first), and close the round."""
        if not self.fragments:
            raise RuntimeError("call attach(model) before syncing")
        held = time.monotonic()
        for f in self.fragments:
            if f.in_flight is not None:
                f.land()
            elif not f.finished:
                f.sync_now()
        self.clock.waited += time.monotonic() - held
        return self._close_round()

    def drain(self) -> None:
        """Land every fragment in flight now (blocking): before a checkpoint, the snapshot and
        the error feedback must not be half way through a round."""
        for f in self.fragments:
            if f.in_flight is not None:
                f.land()

    @property
    def lr_step(self) -> int:
        """The global step the inner lr's warm-up and decay are at for the next step: round × H
        plus the steps of this round, or in rounds by time the steps this site really trained
        (a round's H varies and is not the same at every site)."""
        if self.clock.by_time:
            return self.steps_trained
        return self.round * self.config.inner.steps_per_round + self.steps_in_round

    def trained_data(self) -> list[DataRange]:
        """The windows of this round's steps: all the ledger reserved, or in a round by time the
        first ``steps × data-parallel ranks × batch size`` of them (the steps read them in order)."""
        if not self.clock.by_time:
            return self.data
        windows = self.schedule.steps * self.data_parallel_size * self.config.data.batch_size
        return split_windows(self.data, windows)[0]

    def _close_round(self) -> RoundResult:
        last = self.fragments[-1]
        self.round, self.finished = last.round, all(f.finished for f in self.fragments)
        tokens, steps, waited = self.tokens_in_round, self.steps_in_round, self.clock.waited
        if self.clock.by_time:  # the next round's steps: up to the window, or as measured (streaming)
            schedule = self.clock.next_schedule(self.steps_in_round)
            self.schedule = schedule if self.clock.on_the_clock else self.group.broadcast(schedule)
        else:
            self.clock.restart()
        self.steps_in_round = self.tokens_in_round = 0
        # one fragment: its hash is the whole snapshot's, computed when it merged
        digest = (
            last.digest_after
            if len(self.fragments) == 1 and last.digest_after
            else self.digest(self.snapshot)
        )
        # after a resync the state is that of a later round than the one this site trained
        self.last_result = result = RoundResult(last.round - 1, digest, tokens, self.finished)
        if self.group.rank == 0:  # the time not trained: what a slow site cost (benchmarks/hetero.py)
            log.info("round %d closed: %d steps, the outer sync held them %.3fs", result.round, steps, waited)
        return self.last_result

    def call(self, fn: Callable[[], T]) -> tuple[T | None, Outcome]:
        """``fn()`` and OK, or None and what its failure asks the site to do."""
        try:
            return fn(), Outcome.OK
        except Exception as exc:  # every rank must learn of it, or the others would wait forever
            outcome = _outcome(exc)
            (log.error if outcome is Outcome.FAILED else log.warning)("rank %d: %s", self.group.rank, exc)
            return None, outcome

    @property
    def pull_timeout_s(self) -> float:
        return self.config.round_timeout_s + 300

    def sum_over_ranks(self, *values: float) -> list[float]:
        """Each value summed over the site's ranks (call it on every rank), on the site's control
        group: metrics stay on the host, whatever backend the model's group uses."""
        return self.group.sum_floats(values)

    def report(
        self, eval_loss_sum: float, eval_count: int, train_loss: float, compute_seconds: float
    ) -> None:
        """Tell the coordinator this site's hash of every fragment merged since the last report,
        with the metrics of the round just closed on the fragment that closes it (rank 0)."""
        if self.group.rank != 0:
            return
        while self.merged:
            m = self.merged.popleft()
            metrics = m.fragment == len(self.fragments) - 1
            try:
                report = RoundReport(
                    m.fragment,
                    m.round,
                    m.state_hash,
                    eval_loss_sum if metrics else 0.0,
                    eval_count if metrics else 0,
                    train_loss,
                    m.tokens,
                    compute_seconds if metrics else 0.0,
                )
                ok = self.link.report(report)
            except LinkError as exc:  # metrics only: never worth stopping the training for
                log.warning("report of fragment %d round %d failed: %s", m.fragment, m.round, exc)
                continue
            if not ok:
                log.error(
                    "coordinator reports a hash mismatch of fragment %d after round %d", m.fragment, m.round
                )

    def close(self, reason: str = "done") -> None:
        if self.sender is not None:
            self.sender.shutdown(wait=True, cancel_futures=True)
        if self.group.rank == 0:
            try:
                self.link.leave(reason)
            except LinkError as exc:  # its lease may have lapsed already: nothing to undo
                log.warning("leave failed: %s", exc)
        self.link.close()

    @property
    def bytes_sent(self) -> int:
        return self.link.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.link.bytes_received
