"""Atomic, checksummed snapshots of the coordinator's state, one per committed round.

A snapshot is written to a temporary file, fsynced, renamed over the previous one and the
directory fsynced, so after a crash at any moment the file holds either the previous or the new
round, whole. The payload is read back with ``torch.load(weights_only=True)``: tensors and plain
containers only, never arbitrary pickled objects.

When the run seals its payloads (it has a run secret), the snapshot is sealed too: AES-256-GCM
under a key derived from the run secret for this run and file, in segments small enough for one
AEAD call each, every segment's index, the segment count and the total length bound as associated
data, so a segment cannot be altered, dropped, reordered or moved into another file. θ and the
outer momentum are then as confidential at rest as on the wire.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
from pathlib import Path
from typing import Any

import torch

from geodiloco.security.sealing import NONCE_BYTES, TAG_BYTES, Sealer, SealError

MAGIC = b"GDLSTAT1"
SEALED_MAGIC = b"GDLSTAS1"
_HEADER = struct.Struct("<8s32sQ")  # magic, sha256 of payload, payload length
_SEALED_HEADER = struct.Struct("<8sIQQ")  # magic, key id, payload length, segment length
_SEGMENT_AAD = struct.Struct("<QQQQ")  # segment index, count and length; payload length
SEGMENT_BYTES = 64 << 20  # well under AES-GCM's (and the library's) per-call limit
STATE_FILE = "coordinator.state"
STATE_LABEL = "coordinator-state"  # the at-rest key's label and the segments' associated data


class StateError(ValueError):
    """The run directory holds a state this coordinator must not resume from."""


class CorruptStateError(StateError):
    """A state file that is truncated, altered or not a geodiloco state file."""


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_state(path: Path, state: dict[str, Any], sealer: Sealer | None = None) -> None:
    """Commit ``state``; sealed with ``sealer`` when given, else only checksummed."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    if sealer is None:
        blob = _HEADER.pack(MAGIC, hashlib.sha256(payload).digest(), len(payload)) + payload
    else:
        blob = _seal(payload, sealer)
    write_atomically(path, blob)


def load_state(path: Path, sealer: Sealer | None = None) -> dict[str, Any] | None:
    """The last committed state, or None when there is none yet.

    A sealed run reads only sealed files, with its own key; an unsealed run cannot read a sealed
    file. Anything else is refused with the reason, never loaded."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    magic = data[:8]
    if magic == SEALED_MAGIC:
        if sealer is None:
            raise StateError(
                f"{path} is sealed: start the coordinator with the run's --run-secret to resume from it"
            )
        payload = _open(path, data, sealer)
    elif magic == MAGIC:
        if sealer is not None:
            raise StateError(
                f"{path} is not sealed, but this run seals its state: refusing a file that anyone "
                "with access to the run directory could have written (move it away to start afresh)"
            )
        payload = _checked(path, data)
    else:
        raise CorruptStateError(f"{path}: not a geodiloco coordinator state file")
    state: dict[str, Any] = torch.load(io.BytesIO(payload), weights_only=True)
    return state


def _checked(path: Path, data: bytes) -> bytes:
    if len(data) < _HEADER.size:
        raise CorruptStateError(f"{path}: shorter than its header")
    _, digest, length = _HEADER.unpack_from(data)
    payload = data[_HEADER.size :]
    if len(payload) != length or hashlib.sha256(payload).digest() != digest:
        raise CorruptStateError(f"{path}: checksum mismatch (truncated or altered)")
    return payload


def _segment_aad(index: int, count: int, segment_bytes: int, length: int) -> bytes:
    return SEALED_MAGIC + STATE_LABEL.encode() + _SEGMENT_AAD.pack(index, count, segment_bytes, length)


def _seal(payload: bytes, sealer: Sealer) -> bytes:
    view = memoryview(payload)
    count = max(1, -(-len(payload) // SEGMENT_BYTES))
    parts = [_SEALED_HEADER.pack(SEALED_MAGIC, sealer.key_id, len(payload), SEGMENT_BYTES)]
    for i in range(count):
        segment = bytes(view[i * SEGMENT_BYTES : (i + 1) * SEGMENT_BYTES])
        nonce, sealed = sealer.seal(segment, _segment_aad(i, count, SEGMENT_BYTES, len(payload)))
        parts += (nonce, sealed)
    return b"".join(parts)


def _open(path: Path, data: bytes, sealer: Sealer) -> bytes:
    if len(data) < _SEALED_HEADER.size:
        raise CorruptStateError(f"{path}: shorter than its header")
    _, key_id, length, segment_bytes = _SEALED_HEADER.unpack_from(data)
    if key_id != sealer.key_id:
        raise StateError(
            f"{path} was sealed under another run secret (key id {key_id:08x}, this run's is "
            f"{sealer.key_id:08x}): start the coordinator with the secret of the run that wrote it"
        )
    if not 0 < segment_bytes <= SEGMENT_BYTES:
        raise CorruptStateError(f"{path}: segment length {segment_bytes} out of range (altered)")
    count = max(1, -(-length // segment_bytes))
    expected = _SEALED_HEADER.size + count * (NONCE_BYTES + TAG_BYTES) + length
    if len(data) != expected:
        raise CorruptStateError(
            f"{path}: {len(data)} bytes where the header says {expected} (truncated or altered)"
        )
    out, at = bytearray(), _SEALED_HEADER.size
    for i in range(count):
        size = min(segment_bytes, length - i * segment_bytes) + TAG_BYTES
        nonce, sealed = data[at : at + NONCE_BYTES], data[at + NONCE_BYTES : at + NONCE_BYTES + size]
        at += NONCE_BYTES + size
        try:
            out += sealer.open(nonce, sealed, _segment_aad(i, count, segment_bytes, length))
        except SealError:
            raise CorruptStateError(
                f"{path}: segment {i} of {count} does not authenticate (altered, or not this run's file)"
            ) from None
    return bytes(out)
