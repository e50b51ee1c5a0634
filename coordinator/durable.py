"""Atomic, checksummed snapshots of the coordinator's state, one per committed round.

A snapshot is written to a temporary file, fsynced, renamed over the previous one and the
directory fsynced, so after a crash at any moment the file holds either the previous or the new
round, whole. The payload is read back with ``torch.load(weights_only=True)``: tensors and plain
containers only, never arbitrary pickled objects.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
from pathlib import Path
from typing import Any

import torch

MAGIC = b"GDLSTAT1"
_HEADER = struct.Struct("<8s32sQ")  # magic, sha256 of payload, payload length
STATE_FILE = "coordinator.state"


class CorruptStateError(ValueError):
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


def save_state(path: Path, state: dict[str, Any]) -> None:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    write_atomically(path, _HEADER.pack(MAGIC, hashlib.sha256(payload).digest(), len(payload)) + payload)


def load_state(path: Path) -> dict[str, Any] | None:
    """The last committed state, or None when there is none yet."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(data) < _HEADER.size:
        raise CorruptStateError(f"{path}: shorter than its header")
    magic, digest, length = _HEADER.unpack_from(data)
    payload = data[_HEADER.size :]
    if magic != MAGIC:
        raise CorruptStateError(f"{path}: not a geodiloco coordinator state file")
    if len(payload) != length or hashlib.sha256(payload).digest() != digest:
        raise CorruptStateError(f"{path}: checksum mismatch (truncated or altered)")
    state: dict[str, Any] = torch.load(io.BytesIO(payload), weights_only=True)
    return state
