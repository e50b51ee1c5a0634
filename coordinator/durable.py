"""Atomic, checksummed (or sealed) files of the coordinator's durable state, streamed.

A file is written to a temporary name, fsynced, renamed over the previous one and the directory
fsynced, so after a crash at any moment it holds either the previous or the new content, whole.
Content is streamed (:class:`DurableWriter`): a writer need not know the payload's length or
checksum up front, so a round's update is logged while it is still being computed, and writing
a snapshot of a model of any size costs one segment of memory beyond the tensors.

A state's payload is a small skeleton (plain containers, read with
``torch.load(weights_only=True)``: never arbitrary pickled objects) followed by the raw bytes of
its tensors, each after a few zero bytes that put it at a page-aligned offset of the memory a
reader gives the payload. Files are written and read past the page cache (:mod:`.unbuffered`).
Reading verifies the whole payload before anything in it is parsed: an unsealed file is read
whole into page-aligned memory (its checksum then checked), a sealed one is opened segment by
segment into page-aligned memory; the large tensors of a state are then views of that memory,
not copies, so reading costs the tensors and no more (plus, after a read ahead, the file's
bytes until they are opened). Files written by earlier versions (tensors not aligned, checksum
or segment count in a header, or one ``torch.save`` payload) are still read.

When the run seals its payloads (it has a run secret), these files are sealed too: AES-256-GCM
under a key derived from the run secret for this run, in segments of ``SEGMENT_BYTES``, each
with its index, whether it is the last, and the file's label (what it is, e.g. which round)
bound as associated data, so a segment cannot be altered, dropped, reordered, cut off the end
or moved into another file. θ and the outer momentum are then as confidential at rest as on
the wire.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import xxhash

from geodiloco.coordinator.refusals import CorruptStateError as CorruptStateError
from geodiloco.coordinator.refusals import StateError as StateError
from geodiloco.coordinator.rundir import STATE_FILE as STATE_FILE
from geodiloco.coordinator.unbuffered import (
    BLOCK,
    UnbufferedFile,
    UnbufferedReader,
    page_aligned,
    read_whole,
    taken_ahead,
)
from geodiloco.security.sealing import NONCE_BYTES, TAG_BYTES, Sealer, SealError

# An unsealed file is checksummed against torn writes and corruption, not against an attacker
# (who could rewrite any checksum; sealing is the defence): XXH3-128 at memory speed, where
# SHA-256 (the first version's, still read) took seconds of a restart at 100M parameters. The
# checksum and length follow the payload, so it can be written as it is produced.
MAGIC = b"GDLSTAT3"
_TRAILER = struct.Struct("<16sQ")  # XXH3-128 of payload, payload length
MAGIC_HEADED = b"GDLSTAT2"  # earlier: the checksum in a header
MAGIC_SHA256 = b"GDLSTAT1"
_HEADER = struct.Struct("<8s16sQ")  # magic, XXH3-128 of payload, payload length
_HEADER_SHA256 = struct.Struct("<8s32sQ")  # magic, SHA-256 of payload, payload length
SEALED_MAGIC = b"GDLSTAS2"
_SEALED_HEADER = struct.Struct("<8sIQ")  # magic, key id, segment length
_SEGMENT_AAD = struct.Struct("<QQ?")  # segment index and length; whether it is the last
SEALED_MAGIC_COUNTED = b"GDLSTAS1"  # earlier: the segment count and length in the header
_SEALED_HEADER_COUNTED = struct.Struct("<8sIQQ")  # magic, key id, payload length, segment length
_SEGMENT_AAD_COUNTED = struct.Struct("<QQQQ")  # segment index, count and length; payload length
SEGMENT_BYTES = 64 << 20  # well under AES-GCM's (and the library's) per-call limit
RAW_MAGIC = b"GDLRAW02"  # a payload of skeleton + raw tensors, each after its padding
RAW_MAGIC_UNPADDED = b"GDLRAW01"  # earlier: tensors back to back (and before: one torch.save)
_PAD = struct.Struct("<Q")  # the zero bytes before a tensor's
VIEW_BYTES = 1 << 20  # a tensor this large is a view of the file's memory, a smaller one a copy
STATE_LABEL = "coordinator-state"  # the at-rest key's label and the segments' associated data


def save_state(path: Path, state: dict[str, Any], sealer: Sealer | None = None) -> None:
    """Commit ``state`` (tensors at any depth of plain containers), streamed; sealed with
    ``sealer`` when given, else only checksummed."""
    skeleton, tensors = _split(state, [])
    meta = io.BytesIO()
    torch.save(skeleton, meta)
    with DurableWriter(path, sealer, STATE_LABEL) as out:
        out.write(RAW_MAGIC + struct.pack("<Q", meta.tell()) + meta.getvalue())
        for t in tensors:
            pad = -(out.memory_offset + _PAD.size) % BLOCK
            out.write(_PAD.pack(pad) + bytes(pad))
            out.write(_bytes_of(t))
        out.commit()


def load_state(path: Path, sealer: Sealer | None = None) -> dict[str, Any] | None:
    """The last committed state, or None when there is none yet.

    A sealed run reads only sealed files, with its own key; an unsealed run cannot read a sealed
    file. Anything else is refused with the reason, never loaded."""
    if not path.exists():
        return None
    with _payload(path, sealer, STATE_LABEL) as reader:
        return _read_state(path, reader)


def _read_state(path: Path, reader: _Reader | _MemoryReader) -> dict[str, Any]:
    prefix = reader.read(len(RAW_MAGIC))
    if prefix not in (RAW_MAGIC, RAW_MAGIC_UNPADDED):  # an earlier version's single torch.save
        legacy = prefix + bytes(reader.rest())
        old: dict[str, Any] = torch.load(io.BytesIO(legacy), weights_only=True)
        return old
    (length,) = struct.unpack("<Q", reader.read(8))
    skeleton = torch.load(io.BytesIO(reader.read(length)), weights_only=True)
    tensors: list[torch.Tensor] = []
    state = _join(skeleton, reader, tensors, path, padded=prefix == RAW_MAGIC)
    if len(reader.rest()):
        raise CorruptStateError(f"{path}: bytes after the last tensor (altered)")
    if not isinstance(state, dict):
        raise CorruptStateError(f"{path}: not a coordinator state")
    return state


class DurableWriter:
    """A new content for ``path``, written as it comes (:meth:`write`) to a temporary file and
    made durable and visible by :meth:`commit`; leaving the ``with`` block without committing
    removes the temporary file and keeps the previous content.

    Past the page cache (:mod:`.unbuffered`): a snapshot or a logged update is written once and
    read only by a restart, and through the page cache its fresh pages cost the coordinator more
    CPU than the write itself (a 1.2 GB snapshot took 3.5-4 s at 100M parameters)."""

    def __init__(self, path: Path, sealer: Sealer | None, label: str) -> None:
        self._path, self._tmp = path, path.with_name(path.name + ".tmp")
        self._sealer, self._label = sealer, label
        self._file: UnbufferedFile | None = UnbufferedFile(self._tmp)
        self._digest = xxhash.xxh3_128()
        self._pending = bytearray()  # sealed: the segment not known yet to be the last
        self._index = 0
        self.length = 0
        if sealer is None:
            self._file.write(MAGIC)
        else:
            self._file.write(_SEALED_HEADER.pack(SEALED_MAGIC, sealer.key_id, SEGMENT_BYTES))

    @property
    def memory_offset(self) -> int:
        """Where the next payload byte lands in the page-aligned memory a reader reads the file
        into: an unsealed file is read whole (its offset in the file), a sealed one is opened into
        memory of its own (its offset in the payload)."""
        return self.length if self._sealer is not None else len(MAGIC) + self.length

    def write(self, piece: bytes | bytearray | memoryview) -> None:
        assert self._file is not None, "written after commit"
        piece = memoryview(piece).cast("B")
        self.length += piece.nbytes
        if self._sealer is None:
            self._digest.update(piece)
            self._file.write(piece)  # no segments to cut (they are the sealed format's): no copies
            return
        self._pending += piece
        while len(self._pending) > SEGMENT_BYTES:
            self._seal(bytes(self._pending[:SEGMENT_BYTES]), last=False)
            del self._pending[:SEGMENT_BYTES]

    def _seal(self, segment: bytes, last: bool) -> None:
        assert self._sealer is not None and self._file is not None
        aad = _segment_aad(self._label, self._index, SEGMENT_BYTES, last)
        nonce, sealed = self._sealer.seal(segment, aad)
        self._file.write(nonce)
        self._file.write(sealed)
        self._index += 1

    def commit(self) -> int:
        """Finish, fsync, rename over ``path``, fsync the directory; returns the file's size."""
        assert self._file is not None, "committed twice"
        if self._sealer is None:
            self._file.write(_TRAILER.pack(self._digest.digest(), self.length))
        else:
            self._seal(bytes(self._pending), last=True)
            self._pending = bytearray()
        written = self._file.close()
        self._file.release()
        self._file = None
        os.replace(self._tmp, self._path)
        _fsync_dir(self._path.parent)
        return written

    def abort(self) -> None:
        """Forget what was written (nothing once committed)."""
        if self._file is not None:
            self._file.release()
            self._file = None
            self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> DurableWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.abort()


def read_payload(
    path: Path, sealer: Sealer | None, label: str, into: mmap.mmap | None = None
) -> bytes | memoryview:
    """The whole verified payload of ``path``, read (or opened, when sealed) into ``into`` where
    it fits (a view of it is returned), so that a caller reading file after file, as a restart's
    replay does, reuses its pages: fresh ones cost half the read (0.21 against 0.11 s for a
    98 MB update on this project's VM)."""
    with _payload(path, sealer, label, into) as reader:
        return reader.rest()


@contextlib.contextmanager
def _payload(
    path: Path, sealer: Sealer | None, label: str, into: mmap.mmap | None = None
) -> Iterator[_Reader | _MemoryReader]:
    """A reader of ``path``'s payload, after the checks of its kind: the whole payload is verified
    (every segment of a sealed file, the checksum of an unsealed one) before the reader is
    returned, except in the earliest sealed format, verified segment by segment as it is read."""
    with open(path, "rb") as f:
        magic = f.read(8)
    if magic in (SEALED_MAGIC, SEALED_MAGIC_COUNTED):
        if sealer is None:
            raise StateError(
                f"{path} is sealed: start the coordinator with the run's --run-secret to resume from it"
            )
        ahead = taken_ahead(path)
        with UnbufferedReader(path) if ahead is None else _InMemory(ahead) as file:
            if magic == SEALED_MAGIC:
                yield _MemoryReader(path, _open_sealed(path, file, file.size, sealer, label, into))
            else:
                yield _Reader(_open_counted_segments(path, file, file.size, sealer, label))
        return
    if magic in (MAGIC, MAGIC_HEADED, MAGIC_SHA256):
        if sealer is not None:
            raise StateError(
                f"{path} is not sealed, but this run seals its state: refusing a file that anyone "
                "with access to the run directory could have written (move it away to start afresh)"
            )
        yield _MemoryReader(path, _verified(path, read_whole(path, into)))
        return
    raise CorruptStateError(f"{path}: not a geodiloco coordinator state file")


def _verified(path: Path, data: memoryview) -> memoryview:
    """The payload of a checksummed file's bytes, once its checksum and length are right."""
    magic = bytes(data[: len(MAGIC)])
    if magic == MAGIC:  # checksum and length after the payload
        if data.nbytes < len(MAGIC) + _TRAILER.size:
            raise CorruptStateError(f"{path}: shorter than its checksum")
        expected, length = _TRAILER.unpack_from(data, data.nbytes - _TRAILER.size)
        payload = data[len(MAGIC) : data.nbytes - _TRAILER.size]
    else:  # an earlier version's header (or a file replaced since its magic was read: refused below)
        header = _HEADER_SHA256 if magic == MAGIC_SHA256 else _HEADER
        if data.nbytes < header.size:
            raise CorruptStateError(f"{path}: shorter than its header")
        _, expected, length = header.unpack_from(data)
        payload = data[header.size :]
    digest: Any = hashlib.sha256() if magic == MAGIC_SHA256 else xxhash.xxh3_128()
    digest.update(payload)
    if payload.nbytes != length or digest.digest() != expected:
        raise CorruptStateError(f"{path}: checksum mismatch (truncated or altered)")
    return payload


def _check_key(path: Path, key_id: int, sealer: Sealer) -> None:
    if key_id != sealer.key_id:
        raise StateError(
            f"{path} was sealed under another run secret (key id {key_id:08x}, this run's is "
            f"{sealer.key_id:08x}): start the coordinator with the secret of the run that wrote it"
        )


def _check_segment_bytes(path: Path, segment_bytes: int) -> None:
    if not 0 < segment_bytes <= SEGMENT_BYTES:
        raise CorruptStateError(f"{path}: segment length {segment_bytes} out of range (altered)")


def _open_sealed(
    path: Path,
    f: UnbufferedReader | _InMemory,
    size: int,
    sealer: Sealer,
    label: str,
    into: mmap.mmap | None,
) -> memoryview:
    """The payload of a sealed file, every segment verified and opened straight into page-aligned
    memory (``into``'s where it fits): every segment but the last is ``segment_bytes`` long, so
    the file's size says where each ends, which is the last, and how long the payload is."""
    if size < _SEALED_HEADER.size:
        raise CorruptStateError(f"{path}: shorter than its header")
    _, key_id, segment_bytes = _SEALED_HEADER.unpack(f.read(_SEALED_HEADER.size))
    _check_key(path, key_id, sealer)
    _check_segment_bytes(path, segment_bytes)
    whole, left = NONCE_BYTES + segment_bytes + TAG_BYTES, size - _SEALED_HEADER.size
    count = max(1, -(-left // whole))
    length = left - count * (NONCE_BYTES + TAG_BYTES)
    if length < 0 or left - (count - 1) * whole < NONCE_BYTES + TAG_BYTES:
        raise CorruptStateError(f"{path}: ends inside segment {count - 1} (truncated or altered)")
    payload = memoryview(into if into is not None and len(into) >= length else page_aligned(length))[:length]
    at = 0
    for index in range(count):
        take = min(left, whole)
        left -= take
        nonce, sealed = f.read(NONCE_BYTES), f.read(take - NONCE_BYTES)
        opened = payload[at : at + take - NONCE_BYTES - TAG_BYTES]
        try:
            sealer.open_into(nonce, sealed, _segment_aad(label, index, segment_bytes, left == 0), opened)
        except SealError:
            raise CorruptStateError(
                f"{path}: segment {index} does not authenticate (truncated or altered, or not this "
                "run's file)"
            ) from None
        at += opened.nbytes
    return payload


def _open_counted_segments(
    path: Path, f: UnbufferedReader | _InMemory, size: int, sealer: Sealer, label: str
) -> Iterator[bytes]:
    """The segments of a sealed file of the earlier format: count and length in the header."""
    if size < _SEALED_HEADER_COUNTED.size:
        raise CorruptStateError(f"{path}: shorter than its header")
    _, key_id, length, segment_bytes = _SEALED_HEADER_COUNTED.unpack(f.read(_SEALED_HEADER_COUNTED.size))
    _check_key(path, key_id, sealer)
    _check_segment_bytes(path, segment_bytes)
    count = max(1, -(-length // segment_bytes))
    expected = _SEALED_HEADER_COUNTED.size + count * (NONCE_BYTES + TAG_BYTES) + length
    if size != expected:
        raise CorruptStateError(
            f"{path}: {size} bytes where the header says {expected} (truncated or altered)"
        )
    for i in range(count):
        nonce = f.read(NONCE_BYTES)
        sealed = f.read(min(segment_bytes, length - i * segment_bytes) + TAG_BYTES)
        aad = (
            SEALED_MAGIC_COUNTED + label.encode() + _SEGMENT_AAD_COUNTED.pack(i, count, segment_bytes, length)
        )
        try:
            yield sealer.open(nonce, sealed, aad)
        except SealError:
            raise CorruptStateError(
                f"{path}: segment {i} of {count} does not authenticate (altered, or not this run's file)"
            ) from None


def _segment_aad(label: str, index: int, segment_bytes: int, last: bool) -> bytes:
    return SEALED_MAGIC + label.encode() + _SEGMENT_AAD.pack(index, segment_bytes, last)


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


def _join(
    obj: Any, reader: _Reader | _MemoryReader, tensors: list[torch.Tensor], path: Path, padded: bool
) -> Any:
    """The skeleton with its placeholders filled, reading the tensors in order."""
    if isinstance(obj, dict) and _TENSOR in obj:
        dtype = _DTYPES.get(obj.get("dtype", ""))
        shape = obj.get("shape")
        if dtype is None or not isinstance(shape, list) or obj[_TENSOR] != len(tensors):
            raise CorruptStateError(f"{path}: a tensor's description is not valid (altered)")
        if padded:
            (pad,) = _PAD.unpack(reader.read(_PAD.size))
            if pad >= BLOCK:
                raise CorruptStateError(f"{path}: {pad} bytes of padding before a tensor (altered)")
            reader.read(pad)
        t = reader.tensor(shape, dtype)
        tensors.append(t)
        return t
    if isinstance(obj, dict):
        return {k: _join(v, reader, tensors, path, padded) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join(v, reader, tensors, path, padded) for v in obj]
    return obj


_TENSOR = "__tensor__"


class _Reader:
    """Sequential reads over a stream of verified segments (a sealed file)."""

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

    def tensor(self, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        self.readinto(_bytes_of(t))
        return t

    def rest(self) -> bytes:
        """Everything left; reaching the end also completes the stream's verification."""
        parts = [bytes(self._current)]
        while self._fill():
            parts.append(bytes(self._current))
        self._current = memoryview(b"")
        return b"".join(parts)


class _InMemory(contextlib.AbstractContextManager["_InMemory"]):
    """A file's bytes already read (:func:`.unbuffered.read_ahead`), read like the file (as
    views of them, not copies)."""

    def __init__(self, data: memoryview) -> None:
        self._data, self._at, self.size = data, 0, data.nbytes

    def read(self, n: int) -> memoryview:
        self._at += n
        return self._data[self._at - n : self._at]

    def __exit__(self, *exc: object) -> None:
        self._data.release()


class _MemoryReader:
    """Sequential reads of a verified payload in memory. A large tensor is a view of that memory
    where it is aligned (a padded file's are): the file was read once, straight into it."""

    def __init__(self, path: Path, payload: memoryview) -> None:
        self._path, self._payload, self._at = path, payload, 0

    def _take(self, n: int) -> memoryview:
        if n < 0 or self._at + n > self._payload.nbytes:
            raise CorruptStateError(f"{self._path}: the state ends early (truncated)")
        self._at += n
        return self._payload[self._at - n : self._at]

    def read(self, n: int) -> bytes:
        return bytes(self._take(n))

    def tensor(self, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        data = self._take(numel * dtype.itemsize)
        if not numel:
            return torch.empty(shape, dtype=dtype)
        t = torch.frombuffer(data, dtype=dtype, count=numel).view(shape)
        aligned = t.data_ptr() % 64 == 0  # torch's own alignment: what its kernels may assume
        return t if aligned and data.nbytes >= VIEW_BYTES else t.clone()

    def rest(self) -> memoryview:
        return self._take(self._payload.nbytes - self._at)
