"""The log of committed rounds: one file per round holding its compressed update and record.

A commit costs the disk what the round costs the wire: the downlink update exactly as the sites
receive it (plus a small record), not the model. ``RUN_DIR/updates/<round>.update`` is written
as the update is computed and made durable atomically before the round is published,
checksummed or sealed like the state (:mod:`.durable`, labelled with its round, so a file
cannot be passed off as another round's). A snapshot of
the whole state is taken every few rounds; a restart loads the last snapshot and replays the
updates logged after it, each checked against the hash chain (the θ it starts from and the θ
it gives). The same files serve sites that fell a round or two behind.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from geodiloco.compression import EncodedChunk
from geodiloco.coordinator.durable import CorruptStateError, DurableWriter, read_payload
from geodiloco.coordinator.unbuffered import page_aligned
from geodiloco.security.sealing import Sealer

UPDATES_DIR = "updates"
_SUFFIX = ".update"
_LENGTH = struct.Struct("<Q")
UPDATE_MAGIC = b"GDLUPD02"  # earlier files begin with the record's length: a small number


@dataclass(slots=True)
class LoggedUpdate:
    """One committed round as logged: θ_round + decode(chunks) = θ_{round+1}."""

    run_id: str
    round: int
    codec: str
    base_hash: str  # of θ_round
    state_hash: str  # of θ_{round+1}
    chunks: list[EncodedChunk]
    record: dict[str, Any]  # the round record and each contributor's tokens

    @property
    def payload_bytes(self) -> int:
        return sum(len(c.payload) for c in self.chunks)


def update_path(run_dir: Path, round_: int) -> Path:
    return run_dir / UPDATES_DIR / f"{round_:012d}{_SUFFIX}"


def _label(round_: int) -> str:
    return f"coordinator-update:{round_}"


class UpdateLogWriter:
    """The log file of one round, written while the round is computed: each encoded chunk as it
    comes (:meth:`add`), then the round's record, and only then made durable and visible
    (:meth:`commit`). The payload is the chunks, the record (JSON) and the record's length, so
    nothing about the round need be known before its first chunk is written."""

    def __init__(self, run_dir: Path, round_: int, sealer: Sealer | None) -> None:
        (run_dir / UPDATES_DIR).mkdir(exist_ok=True)
        self.round = round_
        self._out = DurableWriter(update_path(run_dir, round_), sealer, _label(round_))
        self._out.write(UPDATE_MAGIC)
        self._chunks: list[list[int]] = []

    def add(self, chunk: EncodedChunk) -> None:
        self._out.write(chunk.payload)
        self._chunks.append([chunk.start, chunk.numel, len(chunk.payload)])

    def commit(self, update: LoggedUpdate) -> int:
        """Log ``update`` (whose chunks are the ones added, in order) durably; returns the bytes
        written."""
        chunks = [[c.start, c.numel, len(c.payload)] for c in update.chunks]
        if update.round != self.round or chunks != self._chunks:
            raise ValueError(
                f"round {update.round}'s update is not the one written to the log of {self.round}"
            )
        meta = {
            "run_id": update.run_id,
            "round": update.round,
            "codec": update.codec,
            "base_hash": update.base_hash,
            "state_hash": update.state_hash,
            "chunks": chunks,
            "record": update.record,
        }
        tail = json.dumps(meta).encode()
        self._out.write(tail + _LENGTH.pack(len(tail)))
        return self._out.commit()

    def abort(self) -> None:
        """Forget the round's file (nothing once committed)."""
        self._out.abort()

    def __enter__(self) -> UpdateLogWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.abort()


def read_update(
    run_dir: Path, round_: int, sealer: Sealer | None, into: mmap.mmap | None = None
) -> LoggedUpdate | None:
    """The logged update closing ``round_``, verified; None when it is not (or no longer) logged.
    Its chunks are views of ``into`` where the file fits there (see :func:`read_payload`): the
    caller must not reuse it while the update is in use."""
    path = update_path(run_dir, round_)
    if not path.exists():
        return None
    data = memoryview(read_payload(path, sealer, _label(round_), into))
    try:
        if data[: len(UPDATE_MAGIC)] == UPDATE_MAGIC:  # chunks, then the record
            (length,) = _LENGTH.unpack_from(data, data.nbytes - _LENGTH.size)
            end = data.nbytes - _LENGTH.size - length
            if end < len(UPDATE_MAGIC):
                raise ValueError(f"a record of {length} bytes in a payload of {data.nbytes}")
            meta, at = json.loads(bytes(data[end : end + length])), len(UPDATE_MAGIC)
        else:  # an earlier version's: the record, then the chunks
            (length,) = _LENGTH.unpack_from(data)
            meta, at = json.loads(bytes(data[_LENGTH.size : _LENGTH.size + length])), _LENGTH.size + length
            end = data.nbytes
        chunks = []
        for start, numel, size in meta["chunks"]:
            # views of the payload, not copies: a 100 MB update would take fresh pages twice
            chunks.append(EncodedChunk(int(start), int(numel), data[at : at + size]))
            at += size
        update = LoggedUpdate(
            meta["run_id"],
            int(meta["round"]),
            meta["codec"],
            meta["base_hash"],
            meta["state_hash"],
            chunks,
            meta["record"],
        )
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise CorruptStateError(f"{path}: not a logged update ({exc})") from None
    if update.round != round_ or at != end:
        raise CorruptStateError(f"{path}: holds round {update.round}, not {round_} (moved or altered)")
    return update


class UpdateBuffers:
    """Buffers that :func:`read_update` reads into, taken in turn, each grown to the file it must
    hold: reading update after update (a restart's replay) then reuses their pages instead of
    taking fresh ones per update. An update read through it is valid until ``count`` more are."""

    def __init__(self, count: int) -> None:
        self._buffers = [page_aligned(0) for _ in range(count)]
        self._next = 0

    def read(self, run_dir: Path, round_: int, sealer: Sealer | None) -> LoggedUpdate | None:
        try:
            size = update_path(run_dir, round_).stat().st_size
        except FileNotFoundError:
            return None  # not (or no longer) logged, as read_update says
        i, self._next = self._next, (self._next + 1) % len(self._buffers)
        if len(self._buffers[i]) < size:
            self._buffers[i] = page_aligned(size + size // 8)  # room for the next rounds' sizes
        return read_update(run_dir, round_, sealer, self._buffers[i])


def logged_rounds(run_dir: Path) -> list[int]:
    """The rounds with a logged update, in order (leftover temporary files are not rounds)."""
    folder = run_dir / UPDATES_DIR
    if not folder.is_dir():
        return []
    return sorted(
        int(p.name[: -len(_SUFFIX)]) for p in folder.glob(f"*{_SUFFIX}") if p.name[: -len(_SUFFIX)].isdigit()
    )


def prune(run_dir: Path, keep_from: int) -> None:
    """Forget updates before ``keep_from`` (covered by a snapshot and too old for catch-up)."""
    for round_ in logged_rounds(run_dir):
        if round_ < keep_from:
            update_path(run_dir, round_).unlink(missing_ok=True)
    for leftover in (run_dir / UPDATES_DIR).glob("*.tmp"):  # a crash mid-write: never renamed
        leftover.unlink(missing_ok=True)
