"""Pushes received: checked, opened, decoded and staged off the event loop, then folded whole.

Each rank of a site streams the elements it owns as one *part* of the site's contribution
(``PushDelta`` with ``part``/``parts``). Every chunk is authenticated, decoded and checked
(NaN/Inf, Σ Δ² for the norm) in a worker thread as it arrives, while the next chunks are read;
the loop thread only moves bytes. What is staged is the chunk's checked decode in its compact
form, the frame's *raw* bytes (value codes and scales, the entropy stage undone: for int8, one
byte per parameter, within a few percent of the frame on real pseudo-gradients), spilled to an
unlinked temporary file, reused from push to push (:class:`SpillFiles`); folding turns codes
into values and adds them, without decoding the frame again. A push in flight costs the
coordinator about its compressed size on disk and a few chunks of memory, whatever the model or
the number of sites.
Only a contribution whose parts have all arrived, whose elements tile the model exactly (checked
on interval sets, never per-element masks) and whose norm is acceptable is folded into the
round's sum, by the round controller: a broken push never touches the mean.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import IO, TypeVar

import numpy as np
import torch
import xxhash

from geodiloco.compression import Pipeline, Place
from geodiloco.config import LimitsConfig
from geodiloco.coordinator.aggregator import sum_of_squares
from geodiloco.coordinator.fragment_rounds import FragmentedController
from geodiloco.coordinator.journal import Journal
from geodiloco.coordinator.refusals import (
    REFUSALS,
    AlreadyAccepted,
    FailedPrecondition,
    InvalidArgument,
    LateContribution,
    Unavailable,
    refusal_code,
)
from geodiloco.coordinator.round_metrics import CoordinatorMetrics
from geodiloco.coordinator.rounds import RoundController
from geodiloco.coordinator.rounds_pool import bulk_pool
from geodiloco.security.chunks import DeltaMessage, delta_aad, open_delta
from geodiloco.security.sealing import Keyring
from geodiloco.segment import Segment, segment_of
from geodiloco.workload.data import DataRange

log = logging.getLogger("geodiloco.coordinator")

WINDOW = 4  # chunks of one stream decoded while the next are read
WORKERS = min(4, os.cpu_count() or 1)
IDLE_SPILLS = 16  # staging files kept for reuse; more are closed when given back
NOT_SEALING = "this run does not seal payloads (the coordinator runs --insecure): send key_id 0 and no nonce"


class SpillFiles:
    """Unlinked staging files, reused from push to push (thread safe).

    A push's bytes then overwrite pages an earlier push left in the page cache. A new file for
    every push takes fresh pages instead, and on a cloud VM whose host reclaims the guest's free
    memory a fresh page costs far more than a copy: 0.36 s of CPU per 100 MB written to new
    files, against 0.01 s overwriting the same file, measured on this project's 2-core VM.
    """

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self._idle: list[IO[bytes]] = []
        self._lock = threading.Lock()

    def take(self) -> IO[bytes]:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return tempfile.TemporaryFile(dir=self.folder)

    def give_back(self, spill: IO[bytes]) -> None:
        with self._lock:
            if len(self._idle) < IDLE_SPILLS:
                self._idle.append(spill)
                return
        spill.close()


@dataclass(frozen=True, slots=True)
class StagedChunk:
    part: int
    attempt: int
    segment: Segment
    offset: int  # of its raw bytes in the spill file
    length: int


@dataclass(slots=True)
class Staged:
    """The parts received so far of one (site, round) contribution, as checked raw bytes."""

    round: int
    parts: int
    tokens: int
    data: list[DataRange]
    pipeline: Pipeline
    spill: IO[bytes]  # may hold an earlier push's bytes past ``end``
    spills: SpillFiles  # where ``spill`` goes back
    end: int = 0  # of the bytes staged in ``spill``
    chunks: list[StagedChunk] = field(default_factory=list)
    received: set[int] = field(default_factory=set)
    streaming: dict[int, int] = field(default_factory=dict)  # part -> attempt
    sumsq: dict[int, float] = field(default_factory=dict)  # per part
    digests: dict[int, bytes] = field(default_factory=dict)  # per received part (PartStream.digest)
    claimed: int = 0
    attempts: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self, part: int, parts: int, tokens: int, data: list[DataRange]) -> int | None:
        """Start receiving ``part``: its attempt number, or None when it was already received."""
        if (parts, tokens) != (self.parts, self.tokens):
            raise InvalidArgument(
                f"part {part} says {parts} parts and {tokens} tokens; "
                f"earlier parts said {self.parts} parts and {self.tokens} tokens"
            )
        if data and data != self.data:
            raise InvalidArgument(
                f"part {part} names other data ranges than the contribution's earlier parts"
            )
        if part in self.received:
            return None
        if part in self.streaming:
            raise Unavailable(f"part {part} is already being received; retry")
        self.attempts += 1
        self.streaming[part] = self.attempts
        self.sumsq[part] = 0.0
        return self.attempts

    def stage(
        self, part: int, attempt: int, segment: Segment, raw: bytes | memoryview, sumsq: float, limit: int
    ) -> None:
        """Keep one checked chunk's raw bytes (worker thread). A chunk of an abandoned attempt is
        dropped."""
        with self.lock:
            if self.streaming.get(part) != attempt:
                return
            if self.claimed + segment.numel > limit:
                raise InvalidArgument(
                    f"part {part}: chunk at element {segment.start} overlaps elements already pushed "
                    f"(the parts so far hold more than the model's {limit} parameters)"
                )
            length = memoryview(raw).nbytes
            self.spill.seek(self.end)
            self.spill.write(raw)
            self.chunks.append(StagedChunk(part, attempt, segment, self.end, length))
            self.end += length
            self.claimed += segment.numel
            self.sumsq[part] += sumsq

    def finish(self, part: int, digest: bytes) -> None:
        self.streaming.pop(part)
        self.received.add(part)
        self.digests[part] = digest

    def abandon(self, part: int) -> None:
        """A part's stream failed: forget what it staged, so its retry starts clean."""
        with self.lock:
            attempt = self.streaming.pop(part, None)
            if attempt is None:
                return
            kept = [c for c in self.chunks if (c.part, c.attempt) != (part, attempt)]
            self.claimed -= sum(c.segment.numel for c in self.chunks) - sum(c.segment.numel for c in kept)
            self.chunks = kept
            self.sumsq.pop(part, None)

    @property
    def complete(self) -> bool:
        return len(self.received) == self.parts and not self.streaming

    @property
    def total_sumsq(self) -> float:
        return sum(self.sumsq.values())

    @property
    def staged_bytes(self) -> int:
        return sum(c.length for c in self.chunks)

    def check_covered(self, num_params: int) -> None:
        """The parts' elements tile ``[0, num_params)``: no overlap, nothing missing."""
        starts, ends = _intervals([c.segment for c in self.chunks])
        order = np.argsort(starts, kind="stable")
        starts, ends = starts[order], ends[order]
        if starts.size > 1:
            overlap = np.flatnonzero(starts[1:] < ends[:-1])
            if overlap.size:
                at = int(starts[overlap[0] + 1])
                raise InvalidArgument(f"the contribution's parts overlap at element {at}")
        covered = int((ends - starts).sum())
        if covered != num_params or (starts.size and (starts[0] < 0 or ends[-1] > num_params)):
            missing = num_params - covered
            raise InvalidArgument(
                f"all {self.parts} parts arrived but {missing} of {num_params} elements are missing"
            )

    def fold_into(self, total: torch.Tensor, weight: float, first: bool, pool: Executor) -> None:
        """total += weight · Δ (= when ``first``) from each staged chunk's raw bytes, chunks in
        parallel on ``pool`` (their elements are disjoint and cover the model: the coverage
        check passed)."""
        self.spill.flush()
        fd = self.spill.fileno()

        def one(c: StagedChunk) -> None:
            raw = _thread_buffer("staged", c.length)
            if os.preadv(fd, [raw.numpy().data], c.offset) != c.length:
                raise OSError(f"the staging file ends inside a chunk at {c.offset}")
            self.pipeline.fold_raw(raw, Place(self.round, c.segment), total, weight, first)

        with self.lock:
            for _ in pool.map(one, self.chunks):
                pass

    def close(self) -> None:
        self.spills.give_back(self.spill)


_thread_buffers = threading.local()


def _thread_buffer(name: str, length: int) -> torch.Tensor:
    """This thread's buffer ``name``, ``length`` bytes of it, reused from chunk to chunk: a
    fresh one per chunk is a fresh megabyte of pages for the kernel to zero, 100 MB per push
    and pass at 100M parameters."""
    buffer: torch.Tensor | None = getattr(_thread_buffers, name, None)
    if buffer is None or buffer.numel() < length:
        buffer = torch.empty(length, dtype=torch.uint8)
        setattr(_thread_buffers, name, buffer)
    return buffer[:length]


class StagedContribution:
    """A complete, checked :class:`Staged` as the round controller folds it."""

    def __init__(self, staged: Staged, pool: Executor) -> None:
        self.staged = staged
        self.pool = pool
        self.sumsq = staged.total_sumsq
        self.digest = tuple(staged.digests[p] for p in range(staged.parts))  # one per part

    def fold_into(self, total: torch.Tensor, weight: float, first: bool) -> None:
        self.staged.fold_into(total, weight, first, self.pool)


def chunk_digest(chunk: DeltaMessage, opened: bytes | memoryview) -> bytes:
    """XXH3-128 of one chunk as opened: everything it says but its nonce (random per sealing)
    and sealed payload (the fields its sealing authenticates, :func:`delta_aad`), then the
    opened payload. A retry of the same push digests the same.

    The digest only tells an identical repeat of a site's own push from a different one, so it
    needs no collision resistance: a site that forged a collision would only have its own
    second push ignored. SHA-256 here cost 0.5 ms per MB, a tenth of the coordinator's CPU at
    100M parameters; XXH3 costs 0.013 ms. Digests live in memory only (never in a snapshot)."""
    h = xxhash.xxh3_128(delta_aad(chunk))
    h.update(len(opened).to_bytes(8, "little"))
    h.update(opened)
    return h.digest()


def _intervals(segments: list[Segment]) -> tuple[np.ndarray, np.ndarray]:
    """[start, end) of every row of every segment, as two int64 arrays."""
    if not segments:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    rows = np.fromiter((s.rows for s in segments), np.int64, len(segments))
    starts = np.fromiter((s.start for s in segments), np.int64, len(segments))
    strides = np.fromiter((s.stride for s in segments), np.int64, len(segments))
    lengths = np.fromiter((s.row_len for s in segments), np.int64, len(segments))
    which = np.repeat(np.arange(len(segments)), rows)
    first = np.cumsum(rows) - rows
    row = np.arange(int(rows.sum()), dtype=np.int64) - np.repeat(first, rows)
    begin = starts[which] + row * strides[which]
    return begin, begin + lengths[which]


def check_declared(limits: LimitsConfig, chunk: DeltaMessage, num_params: int) -> None:
    """The counts the first chunk of a push declares, against the run's limits."""
    if not 0 < chunk.tokens <= limits.max_tokens:
        raise InvalidArgument(
            f"tokens must be in [1, {limits.max_tokens}] (limits.max_tokens), got {chunk.tokens}"
        )
    most = min(limits.max_chunks_per_part, num_params)
    if not 0 < chunk.total_chunks <= most:
        raise InvalidArgument(
            f"total_chunks {chunk.total_chunks} is out of range [1, {most}] "
            "(limits.max_chunks_per_part, and at most one chunk per parameter)"
        )
    parts = chunk.parts or 1
    if not 0 < parts <= limits.max_parts or chunk.part >= parts:
        raise InvalidArgument(
            f"part {chunk.part} of {parts} is out of range (limits.max_parts {limits.max_parts})"
        )
    if len(chunk.data) > limits.max_data_ranges:
        raise InvalidArgument(
            f"{len(chunk.data)} data ranges exceed limits.max_data_ranges {limits.max_data_ranges}"
        )


def check_segment(segment: Segment, num_params: int, chunk_elements: int, seq: int) -> None:
    """A chunk's place must lie inside the model and hold at most one chunk of elements."""
    s = segment
    if s.rows < 1 or s.row_len < 1 or (s.rows > 1 and s.stride < s.row_len):
        raise InvalidArgument(
            f"chunk {seq}: rows {s.rows}, row length {s.row_len}, stride {s.stride} is no layout"
        )
    if s.numel > chunk_elements or s.end > num_params:
        raise InvalidArgument(
            f"chunk {seq} covers {s.numel} elements up to {s.end}, outside the model's {num_params} "
            f"parameters or over {chunk_elements} elements"
        )


def _segment(chunk: DeltaMessage, seq: int) -> Segment:
    try:
        return segment_of(chunk.header)
    except ValueError as exc:
        raise InvalidArgument(f"chunk {seq}: {exc}") from None


class Intake:
    """Every push in progress, by (site, round); one per coordinator.

    ``opener`` authenticates and opens a chunk's payload (the identity without sealing);
    ``spill_dir`` holds the unlinked staging files (the system's temporary folder without one);
    ``fragment`` is the fragment of the run whose pushes it takes (``num_params`` its size).
    """

    def __init__(
        self,
        pipeline: Pipeline,
        num_params: int,
        chunk_elements: int,
        limits: LimitsConfig,
        opener: Callable[[DeltaMessage], bytes | memoryview],
        spill_dir: Path | None = None,
        fragment: int = 0,
    ) -> None:
        self.fragment = fragment
        self.pipeline = pipeline
        self.num_params = num_params
        self.chunk_elements = chunk_elements
        self.limits = limits
        self.opener = opener
        self.staged: dict[tuple[str, int], Staged] = {}
        self.spills = SpillFiles(spill_dir)
        self.pool = bulk_pool(WORKERS, "intake")

    def forget_site(self, site: str) -> None:
        """A site that (re)joins trains its round over: the parts it staged of an unfinished push
        go, so its new push is not mixed with (or refused against) the one it abandoned."""
        for key in [k for k in self.staged if k[0] == site]:
            with self.staged[key].lock:
                if self.staged[key].streaming:  # a part still in flight ends or fails on its own
                    continue
            self._close(self.staged.pop(key))

    def drop_closed(self, current_round: int) -> None:
        """Forget contributions to rounds that closed without them."""
        for key in [k for k in self.staged if k[1] < current_round]:
            self._close(self.staged.pop(key))

    def _close(self, staged: Staged) -> None:
        # in a worker: a spill file closed past the idle ones frees its pages (tens of ms for a
        # 100 MB push), which the event loop must not wait for
        self.pool.submit(staged.close)

    async def begin(self, first: DeltaMessage) -> PartStream:
        """A stream for the part ``first`` opens, authenticated before anything of it is trusted."""
        h = first.header
        if h.fragment != self.fragment:
            raise InvalidArgument(
                f"a push of fragment {h.fragment} reached the intake of fragment {self.fragment}"
            )
        if h.codec != self.pipeline.spec:
            raise InvalidArgument(f"codec {h.codec!r} is not this run's uplink codec {self.pipeline.spec!r}")
        check_declared(self.limits, first, self.num_params)
        opened = await asyncio.get_running_loop().run_in_executor(self.pool, self.opener, first)
        return PartStream(self, first, opened)

    def staging_for(self, first: DeltaMessage) -> tuple[Staged, int | None]:
        h = first.header
        key = (h.site, h.round)
        parts = first.parts or 1
        data = [DataRange(d.shard, d.start, d.end, d.epoch) for d in first.data]  # as declared
        staged = self.staged.get(key)
        if staged is None:
            staged = Staged(
                h.round, parts, first.tokens, data, self.pipeline, self.spills.take(), self.spills
            )
            self.staged[key] = staged
        return staged, staged.begin(first.part, parts, first.tokens, data)

    def release(self, site: str, staged: Staged) -> None:
        """The contribution is folded or refused as a whole: its staging goes."""
        key = (site, staged.round)
        if self.staged.get(key) is staged:
            del self.staged[key]
        self._close(staged)

    def check_chunk(self, first: DeltaMessage, chunk: DeltaMessage, index: int) -> Segment:
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
        check_segment(segment, self.num_params, self.chunk_elements, h.seq)
        return segment

    def decode_checked(
        self, payload: bytes | memoryview, round_: int, segment: Segment, seq: int
    ) -> tuple[torch.Tensor, float]:
        """Decode one chunk: its raw bytes (what is staged) and Σ Δ² of its values; NaN/Inf is
        refused here (worker thread)."""
        place = Place(round_, segment)
        scratch = _thread_buffer("decoded", self.pipeline.raw_size(segment.numel, place))  # staged, then free
        raw = self.pipeline.unpack(payload, segment.numel, place, scratch)
        sumsq = self.pipeline.raw_sumsq(raw, segment.numel)  # q8: from the codes, no fp32 copy
        if sumsq is None:
            sumsq = sum_of_squares(self.pipeline.decode_raw(raw, segment.numel, place))
        if not sumsq < float("inf"):
            raise InvalidArgument(f"chunk {seq}: pseudo-gradient contains NaN or Inf")
        return raw, sumsq


class PartStream:
    """One ``PushDelta`` stream: one part of a contribution, or a repeat of one received.

    Every chunk is opened and digested, a repeat's too: a repeat is a duplicate only when its
    digest equals the accepted part's (see :meth:`check_repeat`)."""

    def __init__(self, intake: Intake, first: DeltaMessage, opened: bytes | memoryview) -> None:
        self.intake = intake
        self.first = first
        self.site: str = first.header.site
        self.round: int = first.header.round
        self._first_payload: bytes | memoryview | None = opened
        self.staged: Staged | None = None
        self.attempt: int | None = None
        self.index = 0
        self.covered = 0
        self.payload_bytes = 0
        self.pending: deque[asyncio.Future[None]] = deque()
        self.chunk_digests: dict[int, bytes] = {}
        self.repeat_of: bytes | None = None  # the received part's digest, for a repeat of it

    def open(self) -> bool:
        """Join (or start) the contribution's staging; False when this part is a repeat."""
        self.staged, self.attempt = self.intake.staging_for(self.first)
        if self.attempt is None:
            self.repeat_of = self.staged.digests.get(self.first.part)
            self.staged = None
        return self.staged is not None

    @property
    def digest(self) -> bytes:
        """The push's digest: of its chunks' digests, in order (complete once drained)."""
        h = xxhash.xxh3_128()
        for seq in range(self.index):
            h.update(self.chunk_digests[seq])
        return h.digest()

    def check_repeat(self, accepted: tuple[bytes, ...] | None) -> None:
        """A repeat is a duplicate only when identical to the part received or ``accepted`` (the
        contribution's part digests); without either to compare, it is taken as one."""
        part = self.first.part
        expected = self.repeat_of
        if expected is None and accepted is not None:
            expected = accepted[part] if part < len(accepted) else b""
        if expected is not None and self.digest != expected:
            raise AlreadyAccepted(
                f"a different push for round {self.round} (part {part}) was already accepted from "
                f"site {self.site!r}; this one is refused and changed nothing"
            )

    async def add(self, chunk: DeltaMessage) -> None:
        """Check one chunk now; open, decode and stage it in a worker thread."""
        segment = self.intake.check_chunk(self.first, chunk, self.index)
        self.index += 1
        self.covered += segment.numel
        self.payload_bytes += len(chunk.payload)
        payload, self._first_payload = self._first_payload, None
        loop = asyncio.get_running_loop()
        work = loop.run_in_executor(self.intake.pool, self._process, chunk, payload, segment)
        self.pending.append(work)
        if len(self.pending) >= WINDOW:
            await self.pending.popleft()

    def _process(self, chunk: DeltaMessage, opened: bytes | memoryview | None, segment: Segment) -> None:
        staged, attempt = self.staged, self.attempt
        payload = opened if opened is not None else self.intake.opener(chunk)
        self.chunk_digests[chunk.header.seq] = chunk_digest(chunk, payload)
        if staged is None or attempt is None:  # a repeat: compared, never decoded or kept
            return
        raw, sumsq = self.intake.decode_checked(payload, self.round, segment, chunk.header.seq)
        staged.stage(self.first.part, attempt, segment, raw.numpy().data, sumsq, self.intake.num_params)

    async def drain(self) -> None:
        while self.pending:
            await self.pending.popleft()

    def end(self) -> Staged | None:
        """The stream ended whole: the contribution when this part completed it, else None."""
        if self.index != self.first.total_chunks:
            raise InvalidArgument(f"push part ended after {self.index} of {self.first.total_chunks} chunks")
        if self.staged is None:
            return None
        self.staged.finish(self.first.part, self.digest)
        staged, self.staged = self.staged, None
        return staged if staged.complete else None

    def abandon(self) -> None:
        """Give back what a failed part staged; a contribution no part completed goes entirely.
        Chunks still decoding belong to an abandoned attempt and are dropped when they finish."""
        for work in self.pending:
            work.cancel()
            work.add_done_callback(_consume)
        self.pending.clear()
        staged = self.staged
        if staged is None:
            return
        staged.abandon(self.first.part)
        self.staged = None
        if not staged.received and not staged.streaming:
            self.intake.release(self.site, staged)


def _consume(work: asyncio.Future[None]) -> None:
    """Retrieve an abandoned chunk's outcome, so asyncio does not log it as never retrieved."""
    if not work.cancelled():
        work.exception()


D = TypeVar("D", bound=DeltaMessage)  # the message type of a push stream (the edge's)


async def _next(chunks: AsyncIterator[D]) -> D | None:
    """The stream's next chunk, or None at its end."""
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None


class PushOutcome(str, Enum):
    """What one ``PushDelta`` stream came to, when it was not refused."""

    ACCEPTED = "accepted"  # it completed a contribution, which the round folded
    PART = "part"  # one part received; more parts of the contribution are to come
    DUPLICATE = "duplicate"  # an identical repeat of a part received or accepted: changes nothing


@dataclass(frozen=True, slots=True)
class PushReceipt:
    """The outcome of one push stream and what it carried."""

    outcome: PushOutcome
    round: int
    fragment: int
    payload_bytes: int


class Pushes:
    """A whole push, one call in and one outcome out, for every fragment of the run.

    The servicer hands over the stream's chunks; this checks who sent them, routes them to their
    fragment's :class:`Intake`, stages them, and has the fragment's round controller fold a
    completed contribution. A refusal is raised as a domain error (``coordinator.refusals``,
    ``CodecError``, ``SealError``) after it was counted; nothing of a refused push is kept.
    """

    def __init__(
        self,
        run: FragmentedController,
        keyring: Keyring | None,
        metrics: CoordinatorMetrics,
        journal: Journal,
    ) -> None:
        self.run = run
        self.keyring = keyring
        self.metrics = metrics
        self.journal = journal
        self.intakes = [
            Intake(
                c.uplink,
                c.num_params,
                c.cfg.compression.chunk_elements,
                c.cfg.limits,
                self.open_payload,
                c.run_dir,
                fragment=p,
            )
            for p, c in enumerate(run.fragments)
        ]

    def forget_site(self, site: str) -> None:
        """A site that (re)joins pushes its rounds afresh."""
        for intake in self.intakes:
            intake.forget_site(site)

    def open_payload(self, chunk: DeltaMessage) -> bytes | memoryview:
        """A chunk's payload, authenticated and opened with its site's key (worker thread).
        A sealed chunk to a run that does not seal is named as such, not left to fail decoding.
        Unsealed, the payload as received: a view of the message's bytes, not a copy."""
        if self.keyring is None:
            if chunk.header.nonce or chunk.header.key_id:
                raise FailedPrecondition(NOT_SEALING)
            return chunk.payload
        return open_delta(self.keyring.site(chunk.header.site).up, chunk)

    async def receive(
        self, opener: str, chunks: AsyncIterator[D], on_chunk: Callable[[str, D], int]
    ) -> PushReceipt:
        """Take one push stream whole. ``opener`` is the site the transport says opened it ("" when
        it names none); ``on_chunk(site, chunk)`` counts a chunk's wire bytes as it is taken and
        returns them."""
        site, round_, fragment, wire_bytes = "", 0, 0, 0
        c = self.run.primary
        stream: PartStream | None = None
        started = time.time()
        try:
            first = await _next(chunks)
            if first is None:
                raise InvalidArgument("empty push: no chunks received")
            if opener and opener != first.header.site:
                raise InvalidArgument(
                    f"the push opened as site {opener!r} carries chunks of {first.header.site!r}"
                )
            site, round_, fragment = first.header.site, first.header.round, first.header.fragment
            c = self.run.fragment(fragment)  # before anything of the push is read or kept
            stream = await self._begin(c, first)
            chunk: D | None = first
            with self.run.transferring(site):
                while chunk is not None:
                    wire_bytes += on_chunk(site, chunk)
                    await stream.add(chunk)
                    chunk = await _next(chunks)
                await stream.drain()
            outcome = await self._complete(c, stream)
        except REFUSALS as exc:
            if stream is not None:
                stream.abandon()
            c.record_rejection(site, exc)  # a late fragment is counted by its own fragment
            late = isinstance(exc, LateContribution)
            self._record(site, round_, fragment, started, wire_bytes, "late" if late else "rejected", exc)
            raise
        except BaseException:  # cancelled (the stream broke): the retry must find the part free
            if stream is not None:
                stream.abandon()
            raise
        self._record(site, round_, fragment, started, wire_bytes, outcome.value)
        if outcome is not PushOutcome.DUPLICATE:
            self.metrics.push_compressed(site, stream.covered, stream.payload_bytes)
        return PushReceipt(outcome, round_, fragment, stream.payload_bytes)

    async def _begin(self, c: RoundController, first: DeltaMessage) -> PartStream:
        """The stream of this part (of its fragment); a duplicate (already accepted or received)
        only gets checked."""
        h = first.header
        duplicate = c.check_push(h.site, h.run_id, h.round)
        intake = self.intakes[h.fragment]
        stream = await intake.begin(first)  # authenticated before anything of it is kept
        intake.drop_closed(c.round - c.cfg.outer.max_staleness)  # a late part may still be merged
        if not duplicate and not c.check_push(h.site, h.run_id, h.round):
            stream.open()
        return stream

    async def _complete(self, c: RoundController, stream: PartStream) -> PushOutcome:
        """A part ended whole: a part (more to come), a duplicate (an identical repeat; a
        different one is refused), or accepted once its contribution is complete, tiles the
        model and is folded by the controller."""
        staged = stream.end()
        if staged is None and stream.attempt is not None:
            return PushOutcome.PART
        if staged is not None:
            try:
                staged.check_covered(c.num_params)
                h = stream.first.header
                contribution = StagedContribution(staged, stream.intake.pool)
                # only the primary fragment's pushes carry the data the site trained on
                data = staged.data if self.run.settles_data(h.fragment) else None
                accepted = await c.contribute(
                    h.site, h.run_id, h.round, staged.tokens, contribution, data, contribution.digest
                )
            finally:
                stream.intake.release(stream.site, staged)
            if accepted:
                return PushOutcome.ACCEPTED
        stream.check_repeat(c.accepted_digest(stream.site, stream.round))
        return PushOutcome.DUPLICATE

    def _record(
        self,
        site: str,
        round_: int,
        fragment: int,
        started: float,
        wire_bytes: int,
        outcome: str,
        refusal: Exception | None = None,
    ) -> None:
        """Metrics and journal for one push stream."""
        self.metrics.contribution(site, outcome, refusal_code(refusal) if refusal is not None else "")
        self.journal.write(
            "push",
            site=site,
            round=round_,
            **({"fragment": fragment} if self.run.count > 1 else {}),
            t0=started,
            t1=time.time(),
            bytes=wire_bytes,
            outcome=outcome,
        )
