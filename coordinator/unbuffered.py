"""Files written and read past the page cache (``O_DIRECT``): durable data that is written once
and read rarely, such as a round's logged update.

Written through the page cache, every 4 KiB takes a fresh page, and on a cloud VM whose host
reclaims the guest's free memory a fresh page costs far more than the copy into it: a 100 MB
update took 0.3-0.4 s of CPU that way on this project's 2-core VM, against under 0.01 s with
``O_DIRECT`` (the file is fsynced, so the disk's time is paid either way: 0.03-0.06 s here).
Bytes go through one reused, page-aligned buffer, as ``O_DIRECT`` requires; the last block is
padded and the file cut back to its length. Where the file system refuses ``O_DIRECT`` (at
open or at the first write), the file is written buffered.

A restart reads the same way (:class:`UnbufferedReader`), for the same reason: the files are cold
(never in the page cache), and reading 800 MB of snapshot through it cost 1.2 s of CPU here, where
the same bytes from memory took 0.4 s.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

BLOCK = 4096  # alignment of buffer, offsets and lengths (a multiple of any logical block size)
BUFFER_BYTES = 4 << 20
_DIRECT = getattr(os, "O_DIRECT", 0)

_READ_AHEAD = ThreadPoolExecutor(2, thread_name_prefix="read-ahead")  # disk reads: no GIL held
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
            padded = -(-self._used // BLOCK) * BLOCK
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
