"""Sealing and opening the payload of the wire's chunk messages.

The associated data is the chunk header (run, round, fragment, site, seq, start, numel, codec,
key id), the direction, the kind of stream, and the stream-level fields a receiver acts on
(tokens, chunk count and data ranges of a push; next round, state hash, chunk count and data
ranges of an update), so
none of them can be changed or replayed elsewhere without the tag failing.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from geodiloco.security.sealing import ChunkHeaderFields, Sealer, SealError

UPDATE_KINDS = {1: "update", 2: "full_state"}  # outer_sync.PullRequest.Kind values


class KeyMismatch(SealError):
    """A chunk sealed under another key id: the peer's secret is not this run's."""


# What these functions (and the coordinator's intake) read of a chunk message: the generated
# DeltaChunk and UpdateChunk have these fields, so they fit without this library importing them.


class RangeFields(Protocol):
    @property
    def shard(self) -> int: ...
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def epoch(self) -> int: ...


class HeaderFields(Protocol):
    run_id: str
    round: int
    fragment: int
    site: str
    codec: str
    seq: int
    start: int
    numel: int
    rows: int
    stride: int
    key_id: int  # set when sealing
    nonce: bytes  # set when sealing


class ChunkMessage(Protocol):
    payload: bytes  # a received message's may be a view of the bytes read

    @property
    def header(self) -> HeaderFields: ...
    @property
    def total_chunks(self) -> int: ...
    @property
    def data(self) -> Sequence[RangeFields]: ...


class DeltaMessage(ChunkMessage, Protocol):
    """A push's chunk (DeltaChunk)."""

    @property
    def tokens(self) -> int: ...
    @property
    def part(self) -> int: ...
    @property
    def parts(self) -> int: ...


class UpdateMessage(ChunkMessage, Protocol):
    """A pull's chunk (UpdateChunk)."""

    @property
    def next_round(self) -> int: ...
    @property
    def finished(self) -> bool: ...
    @property
    def state_hash(self) -> str: ...
    @property
    def kind(self) -> int: ...


M = TypeVar("M", bound=ChunkMessage)


def _fields(msg: ChunkMessage, direction: str, kind: str) -> ChunkHeaderFields:
    h = msg.header
    return ChunkHeaderFields(
        direction=direction,
        run_id=h.run_id,
        round=h.round,
        fragment=h.fragment,
        site=h.site,
        seq=h.seq,
        start=h.start,
        numel=h.numel,
        codec=h.codec,
        kind=kind,
        key_id=h.key_id,
        rows=h.rows,
        stride=h.stride,
    )


def _ranges(data: Sequence[RangeFields]) -> bytes:
    """The data ledger ranges a chunk carries, so they cannot be swapped either."""
    return b"".join(struct.pack(">IQQI", d.shard, d.start, d.end, d.epoch) for d in data)


def delta_aad(msg: DeltaMessage) -> bytes:
    """Everything a push's chunk says but its nonce and payload, unambiguously encoded."""
    extra = struct.pack(">QIIII", msg.tokens, msg.total_chunks, msg.part, msg.parts, len(msg.data))
    extra += _ranges(msg.data)
    return _fields(msg, "up", "delta").aad(extra)


def update_aad(msg: UpdateMessage) -> bytes:
    """Everything a pull's chunk says but its nonce and payload, unambiguously encoded."""
    kind = UPDATE_KINDS.get(msg.kind, f"kind-{msg.kind}")
    extra = struct.pack(">QI?I", msg.next_round, msg.total_chunks, msg.finished, len(msg.data))
    return _fields(msg, "down", kind).aad(extra + msg.state_hash.encode() + _ranges(msg.data))


def _seal(sealer: Sealer, msg: M, aad_of: Callable[[M], bytes]) -> None:
    msg.payload = _sealed_payload(sealer, msg, msg.payload, aad_of)


def _sealed_payload(
    sealer: Sealer, msg: M, payload: bytes | memoryview, aad_of: Callable[[M], bytes]
) -> bytes:
    """``payload`` sealed for ``msg``, whose header gets the key id and nonce (the payload is
    not part of the associated data, so it may travel outside the message until encoding)."""
    msg.header.key_id = sealer.key_id
    msg.header.nonce, sealed = sealer.seal(payload, aad_of(msg))
    return sealed


def _open(sealer: Sealer, msg: M, aad_of: Callable[[M], bytes]) -> bytes:
    h = msg.header
    if h.key_id == 0 and not h.nonce:
        raise KeyMismatch(f"chunk {h.seq} is not sealed; this run requires sealed payloads")
    if h.key_id != sealer.key_id:
        raise KeyMismatch(
            f"chunk {h.seq} is sealed under key id {h.key_id:08x}, this run expects {sealer.key_id:08x} "
            "(the sender's secret is not this run's)"
        )
    try:
        payload: bytes = sealer.open(h.nonce, msg.payload, aad_of(msg))
    except SealError as exc:
        raise SealError(f"chunk {h.seq}: {exc}") from None
    return payload


def seal_delta(sealer: Sealer, msg: DeltaMessage) -> None:
    """Seal a DeltaChunk's payload in place (sets nonce and key id)."""
    _seal(sealer, msg, delta_aad)


def sealed_delta_payload(sealer: Sealer, msg: DeltaMessage, payload: bytes) -> bytes:
    """:func:`seal_delta` of a DeltaChunk without its payload: sets its nonce and key id and
    returns the sealed ``payload``."""
    return _sealed_payload(sealer, msg, payload, delta_aad)


def sealed_update_payload(sealer: Sealer, msg: UpdateMessage, payload: bytes | memoryview) -> bytes:
    """:func:`sealed_delta_payload` for an UpdateChunk."""
    return _sealed_payload(sealer, msg, payload, update_aad)


def open_delta(sealer: Sealer, msg: DeltaMessage) -> bytes:
    """The plaintext payload of a DeltaChunk, or SealError/KeyMismatch."""
    return _open(sealer, msg, delta_aad)


def seal_update(sealer: Sealer, msg: UpdateMessage) -> None:
    _seal(sealer, msg, update_aad)


def open_update(sealer: Sealer, msg: UpdateMessage) -> bytes:
    return _open(sealer, msg, update_aad)
