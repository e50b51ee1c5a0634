"""Files written and read past the page cache (``O_DIRECT``): durable data that is written once
and read rarely, such as a round's logged update.

Written through the page cache, every 4 KiB takes a fresh page, and on a cloud VM whose host
reclaims the guest's free memory a fresh page costs far more than the copy into it: a 100 MB
update took 0.3-0.4 s of CPU that way on this project's 2-core VM, against under 0.01 s with
``O_DIRECT`` (the file is fsynced, so the disk's time is paid either way: 0.03-0.06 s here).
Bytes go through one reused, page-aligned buffer, as ``O_DIRECT`` requires; the last block is
padded and the file cut back to its length. Where the file system refuses ``O_DIRECT`` (at
open or at the first write), the file is written buffered.

A restart reads the same way, for the same reason: the files are cold (never in the page cache),
and reading 800 MB of snapshot through it cost 1.2 s of CPU here, where the same bytes from memory
took 0.4 s. A checksummed file is read whole (:func:`read_whole`) straight into page-aligned
memory, several pieces at once: no copy out of a bounce buffer, and the disk and the faulting-in of
fresh pages overlap (800 MB: 0.5-0.7 s here, against 1.4-1.6 s through a 4 MiB bounce buffer with
one read ahead). A restarted coordinator starts that read before its imports
(:func:`read_ahead`). Sealed files are read sequentially (:class:`UnbufferedReader`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

BLOCK = 4096  # alignment of buffer, offsets and lengths (a multiple of any logical block size)
BUFFER_BYTES = 4 << 20
_DIRECT = getattr(os, "O_DIRECT", 0)

PIECE_BYTES = 64 << 20  # a whole-file read's pieces, read at once by _PIECE_READERS
_READ_AHEAD = ThreadPoolExecutor(2, thread_name_prefix="read-ahead")  # disk reads: no GIL held
_PIECE_READERS = ThreadPoolExecutor(4, thread_name_prefix="piece-read")  # 4 beat 1 or 2 here
_idle: list[mmap.mmap] = []  # buffers kept for the next file: their pages stay warm
_idle_lock = threading.Lock()


def _take_buffer() -> mmap.mmap:
    with _idle_lock:
        if _idle:
            return _idle.pop()
    return mmap.mmap(-1, BUFFER_BYTES)  # page aligned


def _give_back(buffer: mmap.mmap) -> None:
    with _idle_lock:
        _idle.append(buffer)


class UnbufferedFile:
    """A new file at ``path``, written sequentially with :meth:`write`; :meth:`close` pads,
    truncates to the bytes written and fsyncs. Use it as a context manager."""

    def __init__(self, path: Path) -> None:
        self._fd = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self._buffer = _take_buffer()
        self._view = memoryview(self._buffer)
        self._used = 0
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            take = min(view.nbytes, BUFFER_BYTES - self._used)
            self._view[self._used : self._used + take] = view[:take]
            self._used += take
            self.size += take
            view = view[take:]
            if self._used == BUFFER_BYTES:
                self._drain(BUFFER_BYTES)

    def _drain(self, length: int) -> None:
        """Write the buffer's first ``length`` bytes (a multiple of BLOCK) at the file's end."""
        at = 0
        while at < length:
            try:
                at += os.write(self._fd, self._view[at:length])
            except OSError as exc:
                if exc.errno != errno.EINVAL or not _is_direct(self._fd):
                    raise
                _drop_direct(self._fd)
        self._used = 0

    def close(self) -> int:
        """Write what is buffered, cut the padding, fsync; returns the file's size."""
        if self._used:
            padded = _round_up(self._used)
            self._view[self._used : padded] = bytes(padded - self._used)
            self._drain(padded)
            os.ftruncate(self._fd, self.size)
        os.fsync(self._fd)
        return self.size

    def release(self) -> None:
        """Close the file (without the padding and fsync of :meth:`close`) and keep the buffer."""
        os.close(self._fd)
        self._view.release()
        _give_back(self._buffer)

    def __enter__(self) -> UnbufferedFile:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def page_aligned(nbytes: int) -> mmap.mmap:
    """Fresh zeroed memory of at least ``nbytes``, page aligned, whole blocks: what
    :func:`read_whole` reads into."""
    return mmap.mmap(-1, max(BLOCK, _round_up(nbytes)))


def _round_up(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


@dataclass(frozen=True, slots=True)
class _Identity:
    """Which file a descriptor reads: files are replaced by rename, never rewritten in place,
    so the same identity means the same bytes."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, fd: int) -> _Identity:
        st = os.fstat(fd)
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


_ahead: dict[str, tuple[_Identity, Future[memoryview]]] = {}  # read_ahead's reads, by path
_ahead_lock = threading.Lock()


def read_whole(path: Path, into: mmap.mmap | None = None) -> memoryview:
    """Every byte of ``path``, in page-aligned memory (``into``'s where it has room, else fresh),
    read past the page cache in pieces at once. A read started by :func:`read_ahead` for the
    same file is taken instead of reading again."""
    fd = _open(path, os.O_RDONLY)
    try:
        identity = _Identity.of(fd)
        ahead = _take_ahead(path, identity)
        return ahead if ahead is not None else _read_fd(fd, identity.size, into)
    finally:
        os.close(fd)


def taken_ahead(path: Path) -> memoryview | None:
    """The bytes :func:`read_ahead` read of ``path`` if it is still that file, else None."""
    if not _ahead:  # nothing read ahead (every read but a restart's first): no file to open
        return None
    try:
        fd = _open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return _take_ahead(path, _Identity.of(fd))
    finally:
        os.close(fd)


def _take_ahead(path: Path, identity: _Identity) -> memoryview | None:
    with _ahead_lock:
        started = _ahead.pop(os.path.abspath(path), None)
    if started is None or started[0] != identity:
        return None
    try:
        return started[1].result()
    except Exception:
        return None  # read again, and meet the error there


def read_ahead(path: Path) -> None:
    """Start reading ``path`` whole in the background, for a :func:`read_whole` of it soon; does
    nothing when there is no such file. :func:`drop_read_ahead` forgets what was not taken."""
    try:
        fd = _open(path, os.O_RDONLY)
    except OSError:
        return
    identity = _Identity.of(fd)
    done: Future[memoryview] = Future()

    def read() -> None:
        try:
            done.set_result(_read_fd(fd, identity.size, None))
        except BaseException as exc:  # whatever it is (out of memory too), the reader is not left waiting
            done.set_exception(exc)
        finally:
            os.close(fd)

    with _ahead_lock:
        _ahead[os.path.abspath(path)] = (identity, done)
    threading.Thread(target=read, name="state-read-ahead", daemon=True).start()


def drop_read_ahead() -> None:
    """Forget the reads ahead not taken (their memory goes once they finish)."""
    with _ahead_lock:
        _ahead.clear()


def _read_fd(fd: int, size: int, into: mmap.mmap | None) -> memoryview:
    memory = into if into is not None and len(into) >= _round_up(size) else page_aligned(size)
    view = memoryview(memory)
    starts = range(0, _round_up(size), PIECE_BYTES)
    ends = [min(start + PIECE_BYTES, _round_up(size)) for start in starts]
    got = list(_PIECE_READERS.map(lambda s, e: _pread_all(fd, view[s:e], s), starts, ends))
    for n, start, end in zip(got, starts, ends, strict=True):
        if n < end - start:  # the file's end (files are replaced, never cut): nothing after it
            return view[: min(size, start + n)]
    return view[:size]


def _pread_all(fd: int, out: memoryview, offset: int) -> int:
    """Fill ``out`` from ``offset`` (whole blocks, page aligned); fewer bytes only at the end."""
    done = 0
    while done < out.nbytes:
        try:
            got = os.preadv(fd, [out[done:]], offset + done)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not _is_direct(fd):
                raise
            _drop_direct(fd)
            continue
        done += got
        if not got or got % BLOCK:  # the end of the file
            break
    return done


class UnbufferedReader:
    """Sequential reads of ``path`` through page-aligned buffers, past the page cache where the
    file system allows it (else buffered); the next block is read from disk while this one is
    consumed. A binary file's ``read``, ``readinto`` and ``seek``; use it as a context manager."""

    def __init__(self, path: Path) -> None:
        self._fd = _open(path, os.O_RDONLY)
        self.size = os.fstat(self._fd).st_size
        self._buffer, self._spare = _take_buffer(), _take_buffer()
        self._view = memoryview(self._buffer)
        self._start = 0  # the file offset of the buffer's first byte
        self._filled = 0  # bytes of the file in the buffer
        self._at = 0  # the next byte to read
        self._ahead: Future[int] | None = None  # the spare's read of the block after the buffer's

    def seek(self, offset: int) -> None:
        self._at = offset

    def readinto(self, out: memoryview | bytearray) -> int:
        """Fill ``out`` from the current position; returns the bytes read (fewer only at the end)."""
        view = memoryview(out).cast("B")
        done = 0
        while done < view.nbytes:
            if not self._start <= self._at < self._start + self._filled and not self._fill():
                break
            at = self._at - self._start
            take = min(view.nbytes - done, self._filled - at)
            view[done : done + take] = self._view[at : at + take]
            done += take
            self._at += take
        return done

    def read(self, n: int = -1) -> bytearray:
        """Up to ``n`` bytes (everything left when ``n`` is negative)."""
        want = max(0, self.size - self._at) if n < 0 else n
        out = bytearray(want)
        del out[self.readinto(out) :]
        return out

    def _fill(self) -> bool:
        """Bring the aligned block holding the position into the buffer; False at the end."""
        start = self._at - self._at % BLOCK
        ahead, self._ahead = self._ahead, None
        if ahead is not None and self._start + self._filled == start:
            got = ahead.result()
            self._view.release()
            self._buffer, self._spare = self._spare, self._buffer
            self._view = memoryview(self._buffer)
        else:
            if ahead is not None:
                ahead.result()  # the spare is not to be touched while its read runs
            got = self._pread(self._buffer, start)
        self._start, self._filled = start, got
        if got == BUFFER_BYTES:
            self._ahead = _READ_AHEAD.submit(self._pread, self._spare, start + got)
        return got > self._at - start

    def _pread(self, buffer: mmap.mmap, offset: int) -> int:
        try:
            return os.preadv(self._fd, [buffer], offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not _is_direct(self._fd):
                raise
            _drop_direct(self._fd)
            return os.preadv(self._fd, [buffer], offset)

    def close(self) -> None:
        if self._fd < 0:
            return
        if self._ahead is not None:
            with contextlib.suppress(OSError):
                self._ahead.result()
        os.close(self._fd)
        self._fd = -1
        self._view.release()
        _give_back(self._buffer)
        _give_back(self._spare)

    def __enter__(self) -> UnbufferedReader:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _open(path: Path, flags: int) -> int:
    """``path`` opened with ``flags``, past the page cache where the file system allows it."""
    try:
        return os.open(path, flags | _DIRECT, 0o666)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.open(path, flags, 0o666)


def _is_direct(fd: int) -> bool:
    return bool(_DIRECT and fcntl.fcntl(fd, fcntl.F_GETFL) & _DIRECT)


def _drop_direct(fd: int) -> None:
    """Go on buffered where the file system refuses ``O_DIRECT`` only at the first transfer."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_DIRECT)
