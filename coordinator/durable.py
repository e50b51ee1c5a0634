"""Atomic, checksummed (or sealed) files of the coordinator's durable state, streamed.

A file is written to a temporary name, fsynced, renamed over the previous one and the directory
fsynced, so after a crash at any moment it holds either the previous or the new content, whole.
Content is streamed in segments of at most ``SEGMENT_BYTES``: writing or reading a snapshot of a
model of any size costs one segment of memory beyond the tensors themselves.

A state's payload is a small skeleton (plain containers, read with
``torch.load(weights_only=True)``: never arbitrary pickled objects) followed by the raw bytes of
its tensors, read into freshly allocated tensors. Files are written and read past the page cache
(:mod:`.unbuffered`). Files written by earlier versions (one ``torch.save`` payload) are still
read.

When the run seals its payloads (it has a run secret), these files are sealed too: AES-256-GCM
under a key derived from the run secret for this run, every segment's index, the segment count,
the total length and the file's label (what it is, e.g. which round) bound as associated data, so
a segment cannot be altered, dropped, reordered or moved into another file. θ and the outer
momentum are then as confidential at rest as on the wire.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import xxhash

from geodiloco.coordinator.errors import CorruptStateError as CorruptStateError
from geodiloco.coordinator.errors import StateError as StateError
from geodiloco.coordinator.rundir import STATE_FILE as STATE_FILE
from geodiloco.coordinator.unbuffered import UnbufferedFile, UnbufferedReader
from geodiloco.security.sealing import NONCE_BYTES, TAG_BYTES, Sealer, SealError

# An unsealed file is checksummed against torn writes and corruption, not against an attacker
# (who could rewrite any checksum; sealing is the defence): XXH3-128 at memory speed, where
# SHA-256 (the first version's, still read) took seconds of a restart at 100M parameters.
MAGIC = b"GDLSTAT2"
MAGIC_SHA256 = b"GDLSTAT1"
SEALED_MAGIC = b"GDLSTAS1"
_HEADER = struct.Struct("<8s16sQ")  # magic, XXH3-128 of payload, payload length
_HEADER_SHA256 = struct.Struct("<8s32sQ")  # magic, SHA-256 of payload, payload length
_SEALED_HEADER = struct.Struct("<8sIQQ")  # magic, key id, payload length, segment length
_SEGMENT_AAD = struct.Struct("<QQQQ")  # segment index, count and length; payload length
SEGMENT_BYTES = 64 << 20  # well under AES-GCM's (and the library's) per-call limit
RAW_MAGIC = b"GDLRAW01"  # a payload of skeleton + raw tensors (earlier: one torch.save)
STATE_LABEL = "coordinator-state"  # the at-rest key's label and the segments' associated data


def save_state(path: Path, state: dict[str, Any], sealer: Sealer | None = None) -> None:
    """Commit ``state`` (tensors at any depth of plain containers), streamed; sealed with
    ``sealer`` when given, else only checksummed."""
    skeleton, tensors = _split(state, [])
    meta = io.BytesIO()
    torch.save(skeleton, meta)
    head = RAW_MAGIC + struct.pack("<Q", meta.tell()) + meta.getvalue()
    pieces = [memoryview(head), *(_bytes_of(t) for t in tensors)]
    write_stream(path, pieces, sealer, STATE_LABEL)


def load_state(path: Path, sealer: Sealer | None = None) -> dict[str, Any] | None:
    """The last committed state, or None when there is none yet.

    A sealed run reads only sealed files, with its own key; an unsealed run cannot read a sealed
    file. Anything else is refused with the reason, never loaded."""
    if not path.exists():
        return None
    with UnbufferedReader(path) as f:
        return _read_state(path, _open_reader(path, f, sealer, STATE_LABEL))


def _read_state(path: Path, reader: _Reader | _FileReader) -> dict[str, Any]:
    prefix = reader.read(len(RAW_MAGIC))
    if prefix != RAW_MAGIC:  # an earlier version's single torch.save payload
        legacy = prefix + reader.rest()
        old: dict[str, Any] = torch.load(io.BytesIO(legacy), weights_only=True)
        return old
    (length,) = struct.unpack("<Q", reader.read(8))
    skeleton = torch.load(io.BytesIO(reader.read(length)), weights_only=True)
    tensors: list[torch.Tensor] = []
    state = _join(skeleton, reader, tensors, path)
    if reader.rest():
        raise CorruptStateError(f"{path}: bytes after the last tensor (altered)")
    if not isinstance(state, dict):
        raise CorruptStateError(f"{path}: not a coordinator state")
    return state


def write_stream(path: Path, pieces: Iterable[memoryview], sealer: Sealer | None, label: str) -> int:
    """Write the payload ``pieces`` to ``path`` atomically (see the module docstring); returns the
    bytes written. Past the page cache (:mod:`.unbuffered`): a snapshot or a logged update is
    written once and read only by a restart, and through the page cache its fresh pages cost the
    coordinator more CPU than the write itself (a 1.2 GB snapshot took 3.5-4 s at 100M
    parameters)."""
    pieces = list(pieces)
    length = sum(p.nbytes for p in pieces)
    tmp = path.with_name(path.name + ".tmp")
    blocks = (
        _unsealed_blocks(pieces, length) if sealer is None else _sealed_blocks(pieces, length, sealer, label)
    )
    with UnbufferedFile(tmp) as out:
        for block in blocks:
            out.write(block)
        written = out.close()
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return written


def _unsealed_blocks(pieces: list[memoryview], length: int) -> Iterator[bytes | memoryview]:
    digest = xxhash.xxh3_128()  # a pass of its own, at memory speed: the header comes first
    for piece in pieces:
        digest.update(piece)
    yield _HEADER.pack(MAGIC, digest.digest(), length)
    yield from pieces  # no segments to cut (they are the sealed format's): no copies


def _sealed_blocks(
    pieces: list[memoryview], length: int, sealer: Sealer, label: str
) -> Iterator[bytes | memoryview]:
    yield _SEALED_HEADER.pack(SEALED_MAGIC, sealer.key_id, length, SEGMENT_BYTES)
    count = _count(length, SEGMENT_BYTES)
    for i, segment in enumerate(_segments(pieces, SEGMENT_BYTES)):
        nonce, sealed = sealer.seal(bytes(segment), _segment_aad(label, i, count, SEGMENT_BYTES, length))
        yield nonce
        yield sealed


def read_payload(path: Path, sealer: Sealer | None, label: str) -> bytes | bytearray:
    """The whole verified payload of ``path``."""
    with UnbufferedReader(path) as f:
        return _open_reader(path, f, sealer, label).rest()


def _open_reader(path: Path, f: UnbufferedReader, sealer: Sealer | None, label: str) -> _Reader | _FileReader:
    """A reader of ``f``'s payload, after the checks of its kind (sealed or checksummed). A
    checksummed file is verified at its end: trust what was read only once ``rest()`` returned."""
    magic = f.read(8)
    f.seek(0)
    size = f.size
    if magic == SEALED_MAGIC:
        if sealer is None:
            raise StateError(
                f"{path} is sealed: start the coordinator with the run's --run-secret to resume from it"
            )
        return _Reader(_open_segments(path, f, size, sealer, label))
    if magic in (MAGIC, MAGIC_SHA256):
        if sealer is not None:
            raise StateError(
                f"{path} is not sealed, but this run seals its state: refusing a file that anyone "
                "with access to the run directory could have written (move it away to start afresh)"
            )
        return _FileReader(path, f, size)
    raise CorruptStateError(f"{path}: not a geodiloco coordinator state file")


def _open_segments(path: Path, f: UnbufferedReader, size: int, sealer: Sealer, label: str) -> Iterator[bytes]:
    if size < _SEALED_HEADER.size:
        raise CorruptStateError(f"{path}: shorter than its header")
    _, key_id, length, segment_bytes = _SEALED_HEADER.unpack(f.read(_SEALED_HEADER.size))
    if key_id != sealer.key_id:
        raise StateError(
            f"{path} was sealed under another run secret (key id {key_id:08x}, this run's is "
            f"{sealer.key_id:08x}): start the coordinator with the secret of the run that wrote it"
        )
    if not 0 < segment_bytes <= SEGMENT_BYTES:
        raise CorruptStateError(f"{path}: segment length {segment_bytes} out of range (altered)")
    count = _count(length, segment_bytes)
    expected = _SEALED_HEADER.size + count * (NONCE_BYTES + TAG_BYTES) + length
    if size != expected:
        raise CorruptStateError(
            f"{path}: {size} bytes where the header says {expected} (truncated or altered)"
        )
    for i in range(count):
        nonce = f.read(NONCE_BYTES)
        sealed = f.read(min(segment_bytes, length - i * segment_bytes) + TAG_BYTES)
        try:
            yield sealer.open(nonce, sealed, _segment_aad(label, i, count, segment_bytes, length))
        except SealError:
            raise CorruptStateError(
                f"{path}: segment {i} of {count} does not authenticate (altered, or not this run's file)"
            ) from None


def _count(length: int, segment_bytes: int) -> int:
    return max(1, -(-length // segment_bytes))


def _segment_aad(label: str, index: int, count: int, segment_bytes: int, length: int) -> bytes:
    return SEALED_MAGIC + label.encode() + _SEGMENT_AAD.pack(index, count, segment_bytes, length)


def _segments(pieces: list[memoryview], size: int) -> Iterator[memoryview]:
    """The concatenation of ``pieces`` cut into ``size``-byte segments (the last may be shorter),
    copying only where a segment straddles two pieces."""
    buffer = bytearray()
    for piece in pieces:
        at = 0
        if buffer:
            take = min(size - len(buffer), piece.nbytes)
            buffer += piece[:take]
            at = take
            if len(buffer) == size:
                yield memoryview(buffer)
                buffer = bytearray()
        while piece.nbytes - at >= size:
            yield piece[at : at + size]
            at += size
        if at < piece.nbytes:
            buffer += piece[at:]
    if buffer or not pieces:
        yield memoryview(buffer)


def _fsync_dir(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _bytes_of(t: torch.Tensor) -> memoryview:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data.cast("B")


_DTYPES = {
    str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32)
}


def _split(obj: Any, tensors: list[torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
    """``obj`` with every tensor replaced by a placeholder naming its place in ``tensors``."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {_TENSOR: len(tensors) - 1, "dtype": str(obj.dtype), "shape": list(obj.shape)}, tensors
    if isinstance(obj, dict):
        return {k: _split(v, tensors)[0] for k, v in obj.items()}, tensors
    if isinstance(obj, (list, tuple)):
        return [_split(v, tensors)[0] for v in obj], tensors
    return obj, tensors


def _join(obj: Any, reader: _Reader | _FileReader, tensors: list[torch.Tensor], path: Path) -> Any:
    """The skeleton with its placeholders filled, reading the tensors in order."""
    if isinstance(obj, dict) and _TENSOR in obj:
        dtype = _DTYPES.get(obj.get("dtype", ""))
        shape = obj.get("shape")
        if dtype is None or not isinstance(shape, list) or obj[_TENSOR] != len(tensors):
            raise CorruptStateError(f"{path}: a tensor's description is not valid (altered)")
        t = torch.empty(shape, dtype=dtype)
        reader.readinto(_bytes_of(t))
        tensors.append(t)
        return t
    if isinstance(obj, dict):
        return {k: _join(v, reader, tensors, path) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join(v, reader, tensors, path) for v in obj]
    return obj


_TENSOR = "__tensor__"


class _Reader:
    """Sequential reads over a stream of verified segments."""

    def __init__(self, segments: Iterator[bytes]) -> None:
        self._segments = segments
        self._current = memoryview(b"")

    def _fill(self) -> bool:
        try:
            self._current = memoryview(next(self._segments))
        except StopIteration:
            return False
        return True

    def readinto(self, out: memoryview) -> None:
        at = 0
        while at < out.nbytes:
            if not self._current.nbytes and not self._fill():
                raise CorruptStateError("the state ends early (truncated)")
            take = min(out.nbytes - at, self._current.nbytes)
            out[at : at + take] = self._current[:take]
            self._current = self._current[take:]
            at += take

    def read(self, n: int) -> bytes:
        out = bytearray(n)
        self.readinto(memoryview(out))
        return bytes(out)

    def rest(self) -> bytes:
        """Everything left; reaching the end also completes the stream's verification."""
        parts = [bytes(self._current)]
        while self._fill():
            parts.append(bytes(self._current))
        self._current = memoryview(b"")
        return b"".join(parts)


class _FileReader:
    """Sequential reads of a checksummed file into their destinations (a tensor's memory: no
    copy through segments), hashed as they go and verified by ``rest()``."""

    def __init__(self, path: Path, f: UnbufferedReader, size: int) -> None:
        header = _HEADER if f.read(8) == MAGIC else _HEADER_SHA256
        f.seek(0)
        if size < header.size:
            raise CorruptStateError(f"{path}: shorter than its header")
        _, self._expected, length = header.unpack(f.read(header.size))
        if size - header.size != length:
            raise CorruptStateError(f"{path}: checksum mismatch (truncated or altered)")
        self._path, self._f = path, f
        self._digest: Any = xxhash.xxh3_128() if header is _HEADER else hashlib.sha256()

    def readinto(self, out: memoryview) -> None:
        at = 0
        while at < out.nbytes:
            got = self._f.readinto(out[at:])
            if not got:
                raise CorruptStateError(f"{self._path}: the state ends early (truncated)")
            at += got
        self._digest.update(out)

    def read(self, n: int) -> bytes:
        out = bytearray(n)
        self.readinto(memoryview(out))
        return bytes(out)

    def rest(self) -> bytearray:
        """Everything left, once the whole file is verified."""
        data = self._f.read()
        self._digest.update(data)
        if self._digest.digest() != self._expected:
            raise CorruptStateError(f"{self._path}: checksum mismatch (truncated or altered)")
        return data
