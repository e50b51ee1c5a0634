"""Sealing and opening the payload of the wire's chunk messages.

The associated data is the chunk header (run, round, fragment, site, seq, start, numel, codec,
key id), the direction, the kind of stream, and the stream-level fields a receiver acts on
(tokens, chunk count and data ranges of a push; next round, state hash, chunk count and data
ranges of an update), so
none of them can be changed or replayed elsewhere without the tag failing.
"""

from __future__ import annotations

import struct
from typing import Any

from geodiloco.security.sealing import ChunkHeaderFields, Sealer, SealError

UPDATE_KINDS = {1: "update", 2: "full_state"}  # outer_sync.PullRequest.Kind values


class KeyMismatch(SealError):
    """A chunk sealed under another key id: the peer's secret is not this run's."""


def _fields(msg: Any, direction: str, kind: str) -> ChunkHeaderFields:
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


def _ranges(data: Any) -> bytes:
    """The data ledger ranges a chunk carries, so they cannot be swapped either."""
    return b"".join(struct.pack(">IQQI", d.shard, d.start, d.end, d.epoch) for d in data)


def _delta_aad(msg: Any) -> bytes:
    extra = struct.pack(">QIIII", msg.tokens, msg.total_chunks, msg.part, msg.parts, len(msg.data))
    extra += _ranges(msg.data)
    return _fields(msg, "up", "delta").aad(extra)


def _update_aad(msg: Any) -> bytes:
    kind = UPDATE_KINDS.get(msg.kind, f"kind-{msg.kind}")
    extra = struct.pack(">QI?I", msg.next_round, msg.total_chunks, msg.finished, len(msg.data))
    return _fields(msg, "down", kind).aad(extra + msg.state_hash.encode() + _ranges(msg.data))


def _seal(sealer: Sealer, msg: Any, aad_of: Any) -> None:
    msg.payload = _sealed_payload(sealer, msg, msg.payload, aad_of)


def _sealed_payload(sealer: Sealer, msg: Any, payload: bytes | memoryview, aad_of: Any) -> bytes:
    """``payload`` sealed for ``msg``, whose header gets the key id and nonce (the payload is
    not part of the associated data, so it may travel outside the message until encoding)."""
    msg.header.key_id = sealer.key_id
    msg.header.nonce, sealed = sealer.seal(payload, aad_of(msg))
    return sealed


def _open(sealer: Sealer, msg: Any, aad_of: Any) -> bytes:
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


def seal_delta(sealer: Sealer, msg: Any) -> None:
    """Seal a DeltaChunk's payload in place (sets nonce and key id)."""
    _seal(sealer, msg, _delta_aad)


def sealed_delta_payload(sealer: Sealer, msg: Any, payload: bytes) -> bytes:
    """:func:`seal_delta` of a DeltaChunk without its payload: sets its nonce and key id and
    returns the sealed ``payload``."""
    return _sealed_payload(sealer, msg, payload, _delta_aad)


def sealed_update_payload(sealer: Sealer, msg: Any, payload: bytes | memoryview) -> bytes:
    """:func:`sealed_delta_payload` for an UpdateChunk."""
    return _sealed_payload(sealer, msg, payload, _update_aad)


def open_delta(sealer: Sealer, msg: Any) -> bytes:
    """The plaintext payload of a DeltaChunk, or SealError/KeyMismatch."""
    return _open(sealer, msg, _delta_aad)


def seal_update(sealer: Sealer, msg: Any) -> None:
    _seal(sealer, msg, _update_aad)


def open_update(sealer: Sealer, msg: Any) -> bytes:
    return _open(sealer, msg, _update_aad)
